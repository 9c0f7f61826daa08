"""FSDP2 over dp on top of tensor parallelism over tp (torchtitan's composition) trains under thunder.jit and thunderfx.

A 2x2 ("dp", "tp") mesh: the Llama (thunder_dtensor.testing.llama) gets torchtitan's TP plan on tp, then
``fully_shard`` over dp on each block and on the root. Each dp rank trains on its half of a global batch;
every step's loss (mean over dp) and every parameter's gradient (full value) equal those of the same model
trained on the whole batch in one process, and the gradients have eager FSDP2's placements.
"""

import copy

from thunder_dtensor.testing import mesh_2d
from thunder_dtensor.testing.llama import Llama, LlamaConfig, apply_tp, llama_loss
from thunder_dtensor.testing.training import COMPILERS, PARITY_TOL, assert_grads_match

import pytest
import thunder
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

STEPS = 3


def _fsdp_tp_model(ref: Llama, mesh) -> Llama:
    """torchtitan's order: TP on tp, then fully_shard over dp on each block, then on the root."""
    model = apply_tp(copy.deepcopy(ref), mesh["tp"], loss_parallel=False)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _batch(step: int, cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return tuple(torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g) for _ in range(2))


@pytest.mark.world_size(4)
@pytest.mark.parametrize("compiler", COMPILERS)
def test_fsdp_over_tensor_parallel_llama_trains_like_single_process(compiler):
    cfg = LlamaConfig(layers=1)
    mesh = mesh_2d()
    dp_group, dp_size = mesh.get_group("dp"), mesh.size(0)
    half = slice(mesh.get_local_rank("dp") * 2, mesh.get_local_rank("dp") * 2 + 2)
    torch.manual_seed(0)
    ref = Llama(cfg)
    # eager FSDP2's gradient placements, from a first step run before any compilation (dynamo's fake runs
    # leave DTensor's sharding cache holding fake mask buffers that a later eager vocab-parallel embedding reads)
    eager = _fsdp_tp_model(ref, mesh)
    tokens, labels = _batch(0, cfg)
    llama_loss(eager(tokens[half]), labels[half]).backward()
    eager_grads = {
        name: (p.grad.device_mesh, p.grad.placements, p.grad.to_local().shape) for name, p in eager.named_parameters()
    }
    model = _fsdp_tp_model(ref, mesh)
    compiled = COMPILERS[compiler](model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        tokens, labels = _batch(step, cfg)
        loss = llama_loss(compiled(tokens[half]), labels[half])
        loss.backward()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=dp_group)
        ref_loss = llama_loss(ref(tokens), labels)
        ref_loss.backward()
        torch.testing.assert_close(global_loss / dp_size, ref_loss, **PARITY_TOL)
        assert_grads_match(model, ref, f"{compiler} step {step}")
        grads = {
            name: (p.grad.device_mesh, p.grad.placements, p.grad.to_local().shape)
            for name, p in model.named_parameters()
        }
        assert grads == eager_grads
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    if compiler == "jit":  # steps 2 and 3 reuse the program compiled for step 1
        assert thunder.cache_misses(compiled) == 1 and thunder.cache_hits(compiled) == STEPS - 1
        # one all-gather per parameter in the forward, one reduce-scatter per gradient in the backward
        params = len(list(model.parameters()))
        assert str(thunder.last_traces(compiled)[-1]).count("= dtensor_fsdp_unshard_prim(") == params
        assert str(thunder.last_backward_traces(compiled)[-1]).count("= dtensor_fsdp_reduce_scatter_prim(") == params
    else:
        # dynamo breaks the graph at FSDP2's hooks (``torch._dynamo.disable``d: they run eagerly); every graph
        # between them is one thunder program, nothing split off
        for info in compiled._backend.subgraph_infos:
            assert info.split_reasons == [], [r.info for r in info.split_reasons]
            assert [name for name, _ in info.split_graph_module.named_children()] == ["thunder_0"]
