"""`zeropp.install_as_deepspeed()`: `import deepspeed` (and its submodules,
`find_spec`, `importlib.metadata`) answer with zeropp; every `deepspeed.*` name
that transformers, accelerate and TRL import or reach is covered, except the
listed features zeropp does not have, which fail with one line naming them;
the alias refuses when the real DeepSpeed is installed (unless asked to take
precedence) and when transformers was imported first. Each case runs in a fresh
interpreter: the alias is process-wide."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _python(code: str, tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env={**os.environ, **(env or {})})


def test_import_find_spec_and_metadata_answer_with_zeropp(tmp_path):
    r = _python("""
import importlib.metadata, importlib.util, zeropp
zeropp.install_as_deepspeed()
zeropp.install_as_deepspeed()  # idempotent
import deepspeed, deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
assert deepspeed.initialize is zeropp.initialize and dist.get_rank() == 0
assert get_accelerator().device_name() == 'cpu' and ZeroParamStatus.AVAILABLE.value == 1
assert importlib.util.find_spec('deepspeed') is not None
assert importlib.metadata.version('deepspeed') == deepspeed.__version__ == '0.19.8'
assert importlib.metadata.metadata('deepspeed')['Name'] == 'deepspeed'
try:
    import deepspeed.inference
except ModuleNotFoundError as e:
    print(e)
from deepspeed.pipe import PipelineModule  # importable (scripts import it at the top) ...
from deepspeed.ops.op_builder import CPUAdamBuilder
assert not CPUAdamBuilder().is_compatible() and not any(deepspeed.ops.__compatible_ops__.values())
try:
    PipelineModule(layers=[])  # ... refused when used
except NotImplementedError as e:
    print(e)
""", tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines() == [
        "No module named 'deepspeed.inference': zeropp stands in for DeepSpeed in this process "
        "(zeropp.install_as_deepspeed()) and has no deepspeed.inference (DeepSpeed-Inference "
        "kernels is not part of zeropp)",
        "zeropp: deepspeed PipelineModule (pipeline parallelism) is not part of zeropp"]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers")
def test_install_after_transformers_is_one_clear_error(tmp_path):
    r = _python("import transformers, zeropp\nzeropp.install_as_deepspeed()", tmp_path)
    assert r.returncode == 1 and r.stderr.strip() == (  # one line, no traceback
        "RuntimeError: zeropp.install_as_deepspeed: transformers was imported first and has "
        "already decided DeepSpeed is absent; call zeropp.install_as_deepspeed() before "
        "importing transformers / accelerate / trl")


def test_real_deepspeed_installed_is_refused_unless_zeropp_takes_precedence(tmp_path):
    site = tmp_path / "site"
    (site / "deepspeed").mkdir(parents=True)
    (site / "deepspeed" / "__init__.py").write_text("REAL = True\n")
    (site / "deepspeed-0.19.8.dist-info").mkdir()
    (site / "deepspeed-0.19.8.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
    env = {"PYTHONPATH": str(site)}
    r = _python("import zeropp\nzeropp.install_as_deepspeed()", tmp_path, env)
    last = r.stderr.strip()
    assert r.returncode == 1 and "\n" not in last and last.startswith(
        "RuntimeError: zeropp.install_as_deepspeed: the real DeepSpeed 0.19.8 is installed (")
    assert "pass take_precedence=True" in last
    r = _python("import zeropp\nzeropp.install_as_deepspeed(take_precedence=True)\n"
                "import deepspeed\nassert not hasattr(deepspeed, 'REAL')\n"
                "assert deepspeed.initialize is zeropp.initialize\nprint('zeropp')", tmp_path, env)
    assert r.returncode == 0 and r.stdout.strip() == "zeropp", r.stderr[-2000:]
    # `zeropp launch --as-deepspeed` refuses in the launcher, in one line, before any rank
    script = tmp_path / "s.py"
    script.write_text("import deepspeed\n")
    r = subprocess.run([sys.executable, "-m", "zeropp", "launch", "--nproc", "2",
                        "--as-deepspeed", str(script)], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env={**os.environ, **env})
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "zeropp launch: --as-deepspeed: zeropp.install_as_deepspeed: the real DeepSpeed "
        f"0.19.8 is installed ({site / 'deepspeed' / '__init__.py'}); uninstall it, or pass "
        "take_precedence=True to answer `import deepspeed` with zeropp in this process"], r.stderr


def test_a_deepspeed_folder_of_configs_is_not_the_real_deepspeed(tmp_path):
    (tmp_path / "deepspeed").mkdir()  # e.g. ds_config json files, no __init__.py
    (tmp_path / "deepspeed" / "zero3.json").write_text("{}")
    r = _python("import sys; sys.path.insert(0, '.')\nimport zeropp\n"
                "zeropp.install_as_deepspeed()\nimport deepspeed\n"
                "assert deepspeed.initialize is zeropp.initialize", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]


# ---- coverage: every deepspeed.* name the Hugging Face libraries reach -----------------------
# Names zeropp leaves out on purpose; each is on a path zeropp refuses anyway
# (ZeRO stages 0-2, sequence / tensor parallelism, the
# deepspeed launcher, accelerate's own test script).
NOT_COVERED = {
    "deepspeed.runtime.sequence_parallel.ulysses_sp",
    "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF",
    "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter",
    "deepspeed.launcher.runner", "deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME",
    "deepspeed.runtime.utils", "deepspeed.utils.groups",
    "deepspeed.runtime.utils.move_to_device",
}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "deepspeed":
        return ".".join(["deepspeed", *reversed(parts)])
    return None


def hf_deepspeed_names() -> set[str]:
    """Every `deepspeed...` module imported, name imported from one, and attribute
    chain on the `deepspeed` module, in the installed transformers, accelerate, TRL."""
    names: set[str] = set()
    for pkg in ("transformers", "accelerate", "trl"):
        spec = importlib.util.find_spec(pkg)
        for path in Path(spec.origin).parent.rglob("*.py"):
            text = path.read_text(errors="ignore")
            if "deepspeed" not in text:
                continue
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Import):
                    names |= {a.name for a in node.names if a.name.split(".")[0] == "deepspeed"}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                        and node.module.split(".")[0] == "deepspeed":
                    names.add(node.module)
                    names |= {f"{node.module}.{a.name}" for a in node.names}
                elif isinstance(node, ast.Attribute) and not isinstance(
                        getattr(node, "ctx", None), ast.Store):
                    d = _dotted(node)
                    if d:
                        names.add(d)
    return names


@pytest.mark.skipif(any(importlib.util.find_spec(p) is None
                        for p in ("transformers", "accelerate", "trl")), reason="hf extra")
def test_alias_covers_every_deepspeed_name_transformers_accelerate_and_trl_use(tmp_path):
    names = sorted(hf_deepspeed_names())
    assert len(names) > 30, names  # the scan found their DeepSpeed paths
    r = _python(f"""
import importlib, json, zeropp
zeropp.install_as_deepspeed()
missing = []
for name in {names!r}:
    parts = name.split('.')
    obj, ok = None, False
    for k in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            obj = importlib.import_module('.'.join(parts[:k]))
        except ImportError:
            continue
        try:
            for p in parts[k:]:
                obj = getattr(obj, p)
            ok = True
        except AttributeError:
            pass
        break
    if not ok:
        missing.append(name)
print(json.dumps(missing))
""", tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    missing = set(json.loads(r.stdout))
    assert missing <= NOT_COVERED, sorted(missing - NOT_COVERED)


def test_deepspeed_modules_its_zero3_tests_import_are_importable_and_refuse_in_one_line(tmp_path):
    r = _python("""
import torch, zeropp
zeropp.install_as_deepspeed()
from deepspeed.runtime.torch_autocast import get_comm_dtype, has_comm_dtype
from deepspeed.runtime.zero.partition_parameters import get_allgather_dtype, zero3_linear_wrap
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, DeepSpeedZeroOffloadParamConfig
from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict
from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES
from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3
from deepspeed.ops.adam import DeepSpeedCPUAdam  # accelerate's, for an offload_optimizer config
p = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
print(has_comm_dtype(p), get_comm_dtype(p), get_allgather_dtype(p, p), len(DEFAULT_LEAF_MODULE_CLASSES))
for use in (lambda: DeepSpeedZeroConfig(stage=3), lambda: DeepSpeedZeroOffloadParamConfig(),
            lambda: ensure_zero_ordered_dict(p), lambda: zero3_linear_wrap(p, p),
            lambda: LinearFunctionForZeroStage3.apply(p, p), lambda: DeepSpeedCPUAdam([p])):
    try:
        use()
    except NotImplementedError as e:
        print(e)
print(isinstance({}, ZeROOrderedDict))
""", tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    linear = "(DeepSpeed's memory-efficient linear; zeropp runs torch's F.linear) is not part of zeropp"
    assert r.stdout.strip().splitlines() == [
        "False torch.bfloat16 torch.bfloat16 3",
        "zeropp: DeepSpeedZeroConfig is DeepSpeed-internal (DeepSpeed's pydantic model of "
        "zero_optimization; zeropp reads the section in zeropp.deepspeed.config.parse); zeropp "
        "has no such object",
        "zeropp: deepspeed DeepSpeedZeroOffloadParamConfig (ZeRO-Offload) is not part of zeropp",
        "zeropp: ensure_zero_ordered_dict is DeepSpeed-internal (ZeRO-3's module parameter "
        "dict); zeropp has no such object",
        f"zeropp: deepspeed zero3_linear_wrap {linear}",
        f"zeropp: deepspeed LinearFunctionForZeroStage3.apply {linear}",
        "zeropp: deepspeed DeepSpeedCPUAdam (ZeRO-Offload's CPU optimizer; set zero_optimization."
        'offload_optimizer.device to "none") is not part of zeropp',
        "False"]
