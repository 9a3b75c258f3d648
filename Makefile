# ps-transpiler: every target runs inside the project's own virtualenv (.venv),
# which `make install` creates from pyproject.toml alone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEMO   ?= build/demo

.PHONY: install test demo demo-ray demo-models golden proto bench bench-paddle bench-ray interop clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py ops/kernels/_fused.c ops/kernels/_pcg64.c ops/kernels/_float_kind.h
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,examples,ray]'
	touch $@

# The suite on TEST_WORKERS pytest-xdist workers (a file's tests stay on one worker, so its
# module fixtures run once); TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# The main job, end to end on a program Paddle itself built.
demo: install
	$(PY) examples/demo.py $(DEMO)

# The same job as Ray actors on a local Ray instance (bound to 127.0.0.1; `launch --backend ray`).
demo-ray: install
	$(PY) examples/demo.py $(DEMO)-ray --backend ray

# Paddle-built real models (a small BERT-style encoder; the small ResNet when its example is there),
# each trained with `launch` on 2 pservers x 2 trainers, loss going down.
demo-models: install
	OPENBLAS_NUM_THREADS=1 $(PY) examples/demo_models.py $(DEMO)-models

# Rewrite tests/golden/ from the current code; review the diff like code.
golden: install
	$(PY) -m pytest tests --update-golden -q

# Regenerate proto/*_pb2.py from proto/*.proto.
proto: install
	$(PY) -m grpc_tools.protoc -I. --python_out=. proto/framework.proto
	@if [ -f proto/rpc.proto ]; then \
	  $(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. proto/rpc.proto; fi

bench: install
	$(PY) benchmarks/transpile_scaling.py
	$(PY) benchmarks/ir_scaling.py
	OPENBLAS_NUM_THREADS=1 $(PY) benchmarks/executor_throughput.py
	OPENBLAS_NUM_THREADS=1 $(PY) benchmarks/sparse_table.py
	OPENBLAS_NUM_THREADS=1 $(PY) benchmarks/sparse_footprint.py
	$(PY) benchmarks/pserver_throughput.py

# Ours beside Fluid 1.8.5 on the same Paddle-built programs (2 x 2 sync, and a local step), and
# real models' local step beside Paddle 2.6.2 (ResNets, BERT, GPT).
# Makes Paddle's venv under ~/.cache the first time (tools/paddle_env.py); skips where it cannot.
bench-paddle: install
	$(PY) benchmarks/vs_paddle18.py
	$(PY) benchmarks/models_vs_paddle26.py

# Ray's overhead: job start time and steps/s of the same job under `launch` and `launch --backend ray`.
bench-ray: install
	$(PY) benchmarks/ray_overhead.py

# Our programs on Fluid 1.8.5's own runtime vs the programs Paddle's transpiler writes;
# makes the Fluid 1.8.5 venv (Python 3.7) under ~/.cache on first use.
interop: install
	$(PY) tools/interop.py

clean:
	rm -rf $(VENV) build .pytest_cache
