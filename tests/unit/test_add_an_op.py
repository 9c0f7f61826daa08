"""docs/architecture.md's "How to add an op" is what the code does: its one-statement op, run as written on
two ranks (a fresh process group: the new dispatch entries stay out of every other test's process)."""

import pathlib
import re
import subprocess
import sys

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "architecture.md"

_ON_EACH_RANK = r"""
import sys

import thunder_dtensor  # noqa: F401
from thunder_dtensor.ops.pointwise import dtensor_add_prim, dtensor_mul_prim, unary_op
from thunder_dtensor.primitive import PRIMS
from thunder_dtensor.testing import init_distributed, mesh_1d, shutdown_distributed

import thunder
import torch
from torch.distributed.tensor import Shard, distribute_tensor

init_distributed()
assert "dtensor_expm1_prim" not in PRIMS  # (the fallback would have made dtensor_torch_expm1_prim)
exec(sys.argv[1], globals())
assert PRIMS["dtensor_expm1_prim"].grad_rule is not PRIMS["dtensor_expm1_prim"].generic_grad_rule

full = torch.linspace(-1.0, 1.0, 24).reshape(8, 3)
for as_method in (False, True):
    x = distribute_tensor(full.clone(), mesh_1d(), [Shard(0)]).requires_grad_()
    fn = (lambda t: (t.expm1() * 3).sum()) if as_method else (lambda t: (torch.expm1(t) * 3).sum())
    jitted = thunder.jit(fn)
    loss = jitted(x)
    loss.backward()
    first = str(thunder.last_traces(jitted)[0])
    assert "dtensor_expm1_prim" in first and "dtensor_torch_expm1_prim" not in first, first
    backward = str(thunder.last_backward_traces(jitted)[0])
    reference = full.clone().requires_grad_()
    (torch.expm1(reference) * 3).sum().backward()
    torch.testing.assert_close(loss.full_tensor(), (torch.expm1(full) * 3).sum())
    torch.testing.assert_close(x.grad.full_tensor(), reference.grad)  # 3 * exp(x): the rule, not eager's
    assert x.grad.placements == (Shard(0),)
    assert "dtensor_expm1_vjp_prim" not in backward, backward  # the dedicated rule, not the generic vjp
print("ADDED-OP-RAN", flush=True)
shutdown_distributed()
"""


def _the_docs_statement() -> str:
    section = DOCS.read_text().split("## How to add an op", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "docs/architecture.md: 'How to add an op' has no code block"
    code = block.group(1)
    statements = [line for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(statements) == 1, statements  # one statement: everything about the op
    return code


def test_the_docs_one_statement_op_runs_forward_and_backward_on_two_ranks(tmp_path):
    script = tmp_path / "add_an_op.py"
    script.write_text(_ON_EACH_RANK)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29761"]
        + [str(script), _the_docs_statement()],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("ADDED-OP-RAN") == 2, run.stdout[-3000:]
