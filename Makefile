# One venv, everything installed by `make setup` (called by demo and test).
# torch is pinned: on a machine without a GPU, torch==2.13.0 resolves to the local CPU build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCHRUN := $(VENV)/bin/torchrun
TORCH_SPEC ?= torch==2.13.0
# pyproject.toml admits lightning-thunder 0.2.6 and the 0.2.7 nightly measured (pip would pick the nightly): the
# suite's environment is the release (make compat TORCH=2.13.0 THUNDER=0.2.7.dev20260201 checks the nightly)
THUNDER_SPEC ?= lightning-thunder==0.2.6
# Only rank 0 prints; a failure on any rank still fails the run.
RUN2 := $(TORCHRUN) --nproc-per-node 2 --local-ranks-filter 0
RUN4 := $(TORCHRUN) --nproc-per-node 4 --local-ranks-filter 0

.PHONY: setup demo test test-unit test-dist2 test-dist4 lint op-coverage tp-demo bench fuzz zoo generate-check fusion-check compat thunder-suite clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-build-isolation -e ".[test,hf]" "$(TORCH_SPEC)" "$(THUNDER_SPEC)"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(RUN2) examples/seed.py

test: test-unit test-dist2 test-dist4

# the unit tests start many fresh interpreters (import checks): two workers, one file each at a time
test-unit: setup
	$(PY) -m pytest tests/unit -q -p no:cacheprovider -n 2 --dist loadfile

test-dist2: setup
	$(RUN2) -m pytest tests/distributed -q -p no:cacheprovider --durations=12

test-dist4: setup
	$(RUN4) -m pytest tests/distributed -q -p no:cacheprovider --durations=12

# the full OpInfo sweep, every sample, at world sizes 2 and 4 (about 15 minutes on 2 cores): rewrites docs/op_coverage.md
op-coverage: setup
	$(RUN2) scripts/op_coverage.py
	$(RUN4) scripts/op_coverage.py

# differential fuzzing: random DTensor programs vs plain torch and eager DTensor, thunder.jit with the lowering on
# and off (scripts/fuzz.py; about 1 s per program on 2 cores). Both world sizes run; fails if either finds a failure.
# e.g. make fuzz FUZZ_SEEDS=1000:1500 FUZZ_ARGS="--stop-on-failure --repro-dir /tmp/repros"
FUZZ_SEEDS ?= 0:300
FUZZ_ARGS ?=
fuzz: setup
	$(RUN2) scripts/fuzz.py --seeds $(FUZZ_SEEDS) $(FUZZ_ARGS); s2=$$?; \
	$(RUN4) scripts/fuzz.py --seeds $(FUZZ_SEEDS) $(FUZZ_ARGS); s4=$$?; \
	test $$s2 -eq 0 && test $$s4 -eq 0

# the model zoo: transformers' own tensor parallelism (tp_plan="auto") on a tiny config of every architecture of the
# installed transformers that has a plan, 2 training steps under thunder.jit and thunderfx against the one-process
# model and greedy generate() for one model per family; prints the table and writes it to ZOO_OUT (hours on 2
# cores; docs/tensor_parallel.md, "The model zoo"). e.g. make zoo ZOO_ARGS="--archs llama,gemma2 --frontends jit"
ZOO_OUT ?= zoo-table.md
ZOO_ARGS ?=
zoo: setup
	$(RUN2) scripts/zoo.py --out $(ZOO_OUT) $(ZOO_ARGS)

# tensor-parallel generate() with a KV cache (dynamic and static) on tiny Llama, Qwen3 and Mixtral under thunder.jit and
# thunderfx, greedy and sampling, against the one-process model's tokens, at 2 and 4 ranks (about an hour on 2 cores)
generate-check: setup
	$(RUN2) scripts/generate_check.py --unsharded && $(RUN4) scripts/generate_check.py

# every bench workload under thunder's torch.compile executor, with dtensor_issue_early=True, and with both, each
# against the default thunder.jit, 2 and 4 ranks, both front ends: losses, gradients, collectives a step, inductor
# graphs (about 16 minutes on 2 cores)
fusion-check: setup
	$(RUN2) scripts/fusion_check.py && $(RUN4) scripts/fusion_check.py

# another torch (docs/architecture.md, "Versions"): a venv with it (CUDA wheels of 5-7 GB, deleted afterwards unless
# KEEP=1), the unit tests, the seed and TP examples under thunder.jit and thunderfx, a distributed subset at 2 ranks.
# e.g. make compat TORCH=2.10.0; make compat TORCH=2.13.0 THUNDER=0.2.7.dev20260201 (another lightning-thunder)
THUNDER ?=
TORCH ?= 2.14.1
compat:
	THUNDER=$(THUNDER) bash scripts/compat.sh $(TORCH)

# lightning-thunder's own CPU tests of plain programs (about 1,200: core, grad, update_aliases, interpreter, jit_general,
# transforms, dynamo, ...) without and with `import thunder_dtensor` first, compared test by test (about 40 minutes
# on 2 cores): scripts/thunder_suite.py
thunder-suite: setup
	$(PY) -m pip install -q pytest-benchmark pytest-timeout fdm==0.5.0 hypothesis expecttest
	$(PY) scripts/thunder_suite.py --out thunder_suite_out

tp-demo: setup
	$(RUN2) examples/tp_transformer.py

# step time (interleaved rounds in one process) and first-call time (a fresh process per variant), eager DTensor
# vs torch.compile vs thunder, and an op without a sharding rule (about 12 minutes on 2 cores): writes
# benchmarks/results/results.{json,md,png}, fsdp/results.{json,md,png}, first_call.{json,md}, plain_call_cost.md,
# inference/tp2.json and no_rule.md; see benchmarks/README.md
bench: setup
	$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q matplotlib
	$(PY) benchmarks/first_call.py
	$(PY) benchmarks/plain_call_cost.py
	$(RUN2) benchmarks/bench.py --workloads block,gpt,llama,fsdp --time-limit-s 1200
	$(RUN2) benchmarks/bench.py --workloads fsdp --variants eager,torch.compile,thunder_on,thunderfx_on,limit,limit_compiled \
		--out benchmarks/results/fsdp
	for rotate in allgather alltoall; do for layer in "" --mlp; do \
		$(RUN2) benchmarks/context_parallel.py --rotate $$rotate $$layer || exit 1; done; done
	$(RUN2) benchmarks/inference.py
	$(RUN2) benchmarks/no_rule.py
	$(RUN2) benchmarks/overhead.py --out benchmarks/results/overhead --label "make bench"
	$(RUN2) benchmarks/breakdown.py --rounds 150 --out benchmarks/results/breakdown

lint: setup
	$(VENV)/bin/ruff check thunder_dtensor tests examples scripts benchmarks
	$(VENV)/bin/ruff format --check thunder_dtensor tests examples benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
