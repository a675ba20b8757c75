# scalelab — every target sets itself up: a fresh clone needs only `make compare` or `make test`.
# `make help` lists the targets.
PYTHON     ?= python3
VENV       ?= .venv
# CPU build by default. On a GPU box install your torch into .venv first, then: make setup TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
PIP_FLAGS  ?=
BIN        := $(VENV)/bin
STAMP      := $(VENV)/.scalelab-installed
OUT        ?= runs/compare
REPORT     ?= reports/compare
EXPERIMENT ?= compare
FP8_SWEEP  ?= workload=finetune
BLOCK_SWEEP ?= workload=finetune strategy=native,none
PAGE       ?= docs/findings.md
TRAIN      := WANDB_MODE=$${WANDB_MODE:-offline} $(BIN)/scalelab-train
PYTEST_ARGS ?=
QUICK      ?=
IS_QUICK   := $(filter 1 yes true,$(QUICK))
LONG       ?=
IS_LONG    := $(filter 1 yes true,$(LONG))
# The court (conf/experiment/court.yaml): QUICK=1 is its 5-minute pass: 3 seeds, 400 steps, one evaluation
# (at the end), and only the fp16 cells whose rules can act within 400 steps (GradScaler, verl's 400, areal's 5,
# megatron's 2^32 start, static 8, metaseq's 256, no scaling) and the fp32 reference; the other cells (oat,
# min_scale_1e-10, fairseq_tolerance, hysteresis2, init_2p32, the head in fp32, bf16) run only in the full court
COURT_QUICK_ARGS  := seed=0,1,2 train.steps=400 train.lr_warmup=20 train.eval_every=0 train.checkpoint_every=200
COURT_QUICK_CELLS := native,verl,areal,megatron,static8,metaseq,none
COMMA             := ,
COURT_REFS        := $(if $(IS_QUICK),fp32,fp32$(COMMA)bf16)
COURT_OUT  ?= $(if $(IS_QUICK),runs/court_quick,runs/court)
COURT_PAGE ?= docs/court.md
COURT_LONG_OUT  ?= runs/court_long
COURT_LONG_PAGE ?= docs/court-long.md

.DEFAULT_GOAL := help
.PHONY: help setup test test-all compare compare-full stress court court-long report reproduce bench gpu-pass gpu-sweep stats-schedule doctor-eval replay-check warning-eval clean

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "} {printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install $(PIP_FLAGS) -e ".[dev]" "$(TORCH_SPEC)"  # torch pinned: no extra may swap it
	touch $(STAMP)

setup: $(STAMP) ## Create .venv: torch first (CPU build), then scalelab with its dev extras

test: setup ## Run the test suite (CI path: everything but tests marked slow)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

test-all: setup ## Run every test, slow ones included
	$(BIN)/python -m pytest $(PYTEST_ARGS)

compare: setup ## Run the default comparison (natural workloads: finetune, rl, deep nets, fp8, nvfp4, bf16) and write its report
	$(TRAIN) -m +experiment=$(EXPERIMENT) hydra.sweep.dir=$(OUT)
	$(TRAIN) -m +experiment=$(EXPERIMENT) precision=fp8_e5m2 $(FP8_SWEEP) hydra.sweep.dir=$(OUT)
	$(TRAIN) -m +experiment=$(EXPERIMENT) precision=nvfp4 $(BLOCK_SWEEP) hydra.sweep.dir=$(OUT)
	$(TRAIN) -m +experiment=$(EXPERIMENT) precision=fp32,bf16 strategy=none hydra.sweep.dir=$(OUT)
	OMP_NUM_THREADS=1 $(BIN)/scalelab-replay $(OUT) --table
	$(BIN)/scalelab-report $(OUT) --out $(REPORT) --page $(PAGE)

compare-full: setup ## The larger comparison (every preset, 8 seeds, 800 steps): runs/compare_full
	$(MAKE) compare EXPERIMENT=compare_full OUT=runs/compare_full REPORT=reports/compare_full PAGE=reports/compare_full/findings.md

stress: setup ## The synthetic stress comparison (loss x1e-8, x1e4 spikes; the default until issue 30): runs/stress
	$(MAKE) compare EXPERIMENT=stress OUT=runs/stress REPORT=reports/stress PAGE=reports/stress/findings.md FP8_SWEEP=regime=plain BLOCK_SWEEP='regime=plain strategy=native,none'

court: setup ## The fp16-RL scaler court: every preset and remedy x 10 seeds on rl and finetune, writes docs/court.md (QUICK=1: 3 seeds, 400 steps, 7 fp16 cells + fp32)
	@for wl in rl finetune; do \
	  echo "make court: $$wl: $(if $(IS_QUICK),the QUICK fp16 cells $(COURT_QUICK_CELLS) then fp32,the 12 fp16 cells$(COMMA) then native with the LM head in fp32$(COMMA) then fp32 and bf16) -> $(COURT_OUT)"; \
	  $(TRAIN) -m +experiment=court_$$wl $(if $(IS_QUICK),$(COURT_QUICK_ARGS) strategy=$(COURT_QUICK_CELLS)) hydra.sweep.dir=$(COURT_OUT) || exit 1; \
	  $(if $(IS_QUICK),,$(TRAIN) -m +experiment=court_$$wl strategy=native 'model.keep_fp32=[head]' cell=-keep_head_fp32 hydra.sweep.dir=$(COURT_OUT) || exit 1;) \
	  $(TRAIN) -m +experiment=court_$$wl precision=$(COURT_REFS) strategy=none $(if $(IS_QUICK),$(COURT_QUICK_ARGS)) hydra.sweep.dir=$(COURT_OUT) || exit 1; \
	done
	$(BIN)/python -m analysis.court $(COURT_OUT) --page $(COURT_PAGE) $(if $(IS_QUICK),--quick)

court-long: setup ## The court on rl at 3000 steps (native, megatron, verl, areal, fp32 x 6 seeds): growth intervals act; writes docs/court-long.md
	@echo "make court-long: rl: native, megatron, verl, areal in fp16, then fp32 -> $(COURT_LONG_OUT)"
	$(TRAIN) -m +experiment=court_long hydra.sweep.dir=$(COURT_LONG_OUT)
	$(TRAIN) -m +experiment=court_long precision=fp32 strategy=none hydra.sweep.dir=$(COURT_LONG_OUT)
	$(BIN)/python -m analysis.court.long $(COURT_LONG_OUT) --page $(COURT_LONG_PAGE)

report: setup ## Rebuild the report of an existing sweep: make report OUT=runs/compare
	OMP_NUM_THREADS=1 $(BIN)/scalelab-replay $(OUT) --table
	$(BIN)/scalelab-report $(OUT) --out $(REPORT)

reproduce: setup ## Re-test the published loss-scaling claims, write docs/reproductions.md (QUICK=1: the 5-min subset; LONG=1: the claims with a horizon, at it -> docs/reproductions-long.md)
	WANDB_MODE=$${WANDB_MODE:-offline} OMP_NUM_THREADS=1 $(BIN)/scalelab-reproduce $(if $(IS_QUICK),--quick) $(if $(IS_LONG),--long)

bench: setup ## Strategy overhead and statistics-pass benchmark (prints ratios, writes JSON and docs/bench-cpu.md)
	$(BIN)/scalelab-bench --threads 1 --write-docs docs/bench-cpu.md

stats-schedule: setup ## stats_every / stats_layers against k=1, all layers, paired by seed (39 runs): docs/stats-schedule.md
	rm -rf runs/stats_schedule
	/usr/bin/time -f "%e s wall" -o runs/stats_schedule.time sh -c 'OMP_NUM_THREADS=1 $(BIN)/scalelab-train -m +experiment=stats_schedule hydra.sweep.dir=runs/stats_schedule && OMP_NUM_THREADS=1 $(BIN)/scalelab-train -m +experiment=stats_schedule strategy=underflow_target,max_ema "strategy.stats_every=choice(1)" strategy.stats_layers=0.5,0.25 hydra.sweep.dir=runs/stats_schedule'
	$(BIN)/python -m analysis.stats_schedule runs/stats_schedule --cost "39 runs, $$(cat runs/stats_schedule.time) on $$(nproc) CPUs (make stats-schedule)"

GPU_ARCH ?= 9.0
GPU_PY ?= $(BIN)/python
gpu-pass: ## On a CUDA machine (torch with CUDA in .venv, or GPU_PY=python3 with hydra-core installed), <= 8 min: every gpu-marked test, then docs/bench.md
	TORCH_CUDA_ARCH_LIST="$(GPU_ARCH)" timeout 360 $(GPU_PY) -m pytest -q -p no:cacheprovider -m gpu tests/cuda tests/experiments/test_bench_gpu.py
	TORCH_CUDA_ARCH_LIST="$(GPU_ARCH)" timeout 120 $(GPU_PY) -m experiments.bench.cli --device cuda --out bench-gpu.json --write-docs docs/bench.md

gpu-sweep: ## On a CUDA machine with nvcc, ~1 min: the statistics kernel per launch geometry beside a plain copy, scale and read of the same bytes, results checked equal (cuda/bench/sweep.sh)
	cuda/bench/sweep.sh build build/sweep sm_$(subst .,,$(GPU_ARCH)) && cuda/bench/sweep.sh run build/sweep

doctor-eval: setup ## The doctor's labelled fault suite: accuracy table printed and written to docs/doctor.md
	OMP_NUM_THREADS=1 $(BIN)/python -m experiments.doctor.evaluate

replay-check: setup ## Replay every strategy on other rules' traces vs real runs, and on the court's runs when runs/court exists (4.1 min of CPU, 18.9 min wall on the loaded 2-core machine): docs/replay.md
	WANDB_MODE=disabled OMP_NUM_THREADS=1 $(BIN)/python -m experiments.replay.check

warning-eval: setup ## Fit and evaluate the early warning on labelled runs, held-out seeds and workloads, and near-edge runs at a third of the failing learning rate (144 runs: 12.5 min of CPU; seconds when they are reused): docs/early-warning.md
	WANDB_MODE=disabled OMP_NUM_THREADS=1 $(BIN)/python -m experiments.warning.evaluate

clean: ## Remove runs, reports and caches (keeps .venv)
	rm -rf runs reports outputs multirun .pytest_cache .hypothesis
