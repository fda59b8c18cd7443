"""`zeropp.install_as_deepspeed()`: after it, in this process, `import deepspeed`
and `import deepspeed.<sub>` answer with zeropp's compat modules, and
`importlib.util.find_spec("deepspeed")` / `importlib.metadata.version("deepspeed")`
answer too, so Hugging Face transformers, accelerate and TRL take their
DeepSpeed path and run on zeropp (pymysql's `install_as_MySQLdb()` pattern).

[Note: how the alias works]
Every name in NAMES is put into `sys.modules` at install: real zeropp modules
where one implements that DeepSpeed module (`deepspeed.zero` is
zeropp/deepspeed/zero.py), small namespace modules for DeepSpeed's package
levels (`deepspeed.runtime`, `deepspeed.runtime.zero`) and for the few names
the libraries import from elsewhere (`deepspeed.utils.logger`, ...), built in
`_namespaces`. A finder first on `sys.meta_path` refuses any other
`deepspeed.*` name with one line saying what zeropp does not implement, and
a distribution finder answers `importlib.metadata` for "deepspeed" with
DEEPSPEED_VERSION: the DeepSpeed release whose API and semantics zeropp's
front door follows.

transformers picks `HfDeepSpeedConfig`'s base class when it is imported, so
the alias must be in place before transformers, accelerate or TRL are
imported; install refuses (one line) when they were imported first.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import types
from pathlib import Path
from typing import Any, Optional

from ..guards import one_line

DEEPSPEED_VERSION = "0.19.8"

# DeepSpeed module name -> the zeropp module that implements it.
NAMES = {
    "deepspeed.accelerator": "zeropp.deepspeed.accelerator",
    "deepspeed.comm": "zeropp.deepspeed.comm",
    "deepspeed.zero": "zeropp.deepspeed.zero",
    "deepspeed.runtime.engine": "zeropp.deepspeed.engine",
    "deepspeed.runtime.lr_schedules": "zeropp.deepspeed.lr_schedules",
    "deepspeed.utils": "zeropp.deepspeed.utils",
    "deepspeed.utils.zero_to_fp32": "zeropp.deepspeed.zero_to_fp32",
    "deepspeed.utils.tensor_fragment": "zeropp.deepspeed.tensor_fragment",
}

# DeepSpeed features zeropp leaves out, for the refusal's message (the few names of
# them that scripts import at module level are importable: absent.py).
NOT_HERE = {
    "deepspeed.moe": "Mixture-of-Experts",  # but for the two names in _namespaces
    "deepspeed.pipe": "pipeline parallelism",
    "deepspeed.runtime.pipe": "pipeline parallelism",
    "deepspeed.inference": "DeepSpeed-Inference kernels",
    "deepspeed.ops": "DeepSpeed's compiled ops (use torch.optim)",
    "deepspeed.compression": "model compression",
    "deepspeed.sequence": "sequence parallelism (Ulysses)",
}

# Libraries whose DeepSpeed detection is fixed when they are imported.
_TOO_LATE = ("transformers", "accelerate", "trl")


class _Loader(importlib.abc.Loader):
    """Returns the module install put in sys.modules (for find_spec's answers)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return sys.modules.get(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    """Refuses `deepspeed.*` names the alias does not have; answers
    importlib.metadata for the "deepspeed" distribution."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        if fullname in sys.modules:
            return sys.modules[fullname].__spec__
        what = next((v for k, v in NOT_HERE.items()
                     if fullname == k or fullname.startswith(k + ".")), None)
        why = f" ({what} is not part of zeropp)" if what else ""
        raise ModuleNotFoundError(
            f"No module named {fullname!r}: zeropp stands in for DeepSpeed in this process "
            f"(zeropp.install_as_deepspeed()) and has no {fullname}{why}", name=fullname)

    def find_distributions(self, context: Any = None) -> Any:
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() == "deepspeed":
            yield _Distribution()


class _Distribution(importlib.metadata.Distribution):
    def read_text(self, filename: str) -> Optional[str]:
        if filename in ("METADATA", "PKG-INFO"):
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {DEEPSPEED_VERSION}\n"
                    "Summary: zeropp standing in for DeepSpeed (zeropp.install_as_deepspeed)\n")
        if filename == "top_level.txt":
            return "deepspeed\n"
        return None

    def locate_file(self, path: Any) -> Path:
        return Path(__file__).parent / str(path)


_finder: Optional[_Finder] = None


def installed() -> bool:
    return _finder is not None


def install_as_deepspeed(take_precedence: bool = False) -> None:
    """Make `import deepspeed` (and its submodules, `find_spec`, `importlib.metadata`)
    answer with zeropp in this process. Call it before importing transformers,
    accelerate or TRL. Refuses when the real DeepSpeed is installed, unless
    `take_precedence=True`; refuses when it is already imported. Idempotent."""
    global _finder
    if _finder is not None:
        return
    real = sys.modules.get("deepspeed")
    if real is not None:
        raise one_line(RuntimeError(
            "zeropp.install_as_deepspeed: the real DeepSpeed is already imported in this "
            "process; call install_as_deepspeed() before anything imports deepspeed"))
    late = sorted(m for m in _TOO_LATE if m in sys.modules)
    if late:
        raise one_line(RuntimeError(
            f"zeropp.install_as_deepspeed: {', '.join(late)} was imported first and has "
            "already decided DeepSpeed is absent; call zeropp.install_as_deepspeed() before "
            f"importing {' / '.join(_TOO_LATE)}"))
    spec = importlib.util.find_spec("deepspeed")
    if spec is not None and spec.origin is None:
        spec = None  # a namespace package: a `deepspeed/` folder of configs, not DeepSpeed
    if spec is not None and not take_precedence:
        try:
            version = importlib.metadata.version("deepspeed")
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        raise one_line(RuntimeError(
            f"zeropp.install_as_deepspeed: the real DeepSpeed {version} is installed "
            f"({spec.origin}); uninstall it, or pass take_precedence=True to answer "
            "`import deepspeed` with zeropp in this process"))
    modules = _namespaces()
    for name, target in NAMES.items():
        modules[name] = importlib.import_module(target)
    for name in sorted(modules):  # parents first: children become their attributes
        sys.modules[name] = modules[name]
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], leaf, modules[name])
    _finder = _Finder()
    sys.meta_path.insert(0, _finder)
    importlib.invalidate_caches()


def _package(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name, attrs.pop("__doc__", None))
    m.__spec__ = importlib.machinery.ModuleSpec(name, _Loader(), is_package=True,
                                                origin="zeropp")
    m.__path__, m.__file__ = [], __file__
    m.__loader__, m.__package__ = m.__spec__.loader, name
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def _namespaces() -> dict[str, types.ModuleType]:
    """DeepSpeed's package levels and the names the libraries import from them."""
    import torch

    from . import absent, accelerator, engine, lr_schedules, zero
    from .config import DeepSpeedConfigError
    top = importlib.import_module("zeropp.deepspeed")
    public = {k: getattr(top, k) for k in top.__all__}
    return {
        "deepspeed": _package("deepspeed", __doc__="zeropp standing in for DeepSpeed",
                              __version__=DEEPSPEED_VERSION, **public,
                              init_inference=_not_here("deepspeed.init_inference",
                                                       "DeepSpeed-Inference"),
                              tp_model_init=_not_here("deepspeed.tp_model_init",
                                                      "tensor parallelism")),
        "deepspeed.runtime": _package("deepspeed.runtime", DeepSpeedEngine=engine.DeepSpeedEngine,
                                      lr_schedules=lr_schedules),
        "deepspeed.runtime.zero": _package(
            "deepspeed.runtime.zero", ZeroParamStatus=zero.ZeroParamStatus,
            GatheredParameters=zero.GatheredParameters, Init=zero.Init,
            MiCS_Init=zero.MiCS_Init,
            unwrap_model_for_generation=zero.unwrap_model_for_generation),
        "deepspeed.runtime.config": _package("deepspeed.runtime.config",
                                             DeepSpeedConfigError=DeepSpeedConfigError),
        # transformers swaps `zero_wrapper_for_fp_tensor_constructor` around its
        # zero.Init; zeropp's Init wraps nothing, so the wrapper is never called.
        "deepspeed.runtime.zero.partition_parameters": _package(
            "deepspeed.runtime.zero.partition_parameters", ZeroParamStatus=zero.ZeroParamStatus,
            GatheredParameters=zero.GatheredParameters, Init=zero.Init,
            register_external_parameter=zero.register_external_parameter,
            zero_wrapper_for_fp_tensor_constructor=lambda fn, *a, **k: fn,
            _orig_torch_arange=torch.arange, get_accelerator=accelerator.get_accelerator,
            partitioned_param_data_shape=[0],  # DeepSpeed's empty partitioned .data
            zero3_linear_wrap=absent.zero3_linear_wrap,
            get_allgather_dtype=absent.get_allgather_dtype,
            **absent.absent_types(absent.PARTITION_PARAMETERS_TYPES)),
        # Scripts import these at the top even when they run no MoE layer.
        "deepspeed.moe": _package("deepspeed.moe"),
        "deepspeed.moe.utils": _package(
            "deepspeed.moe.utils",
            split_params_into_different_moe_groups_for_optimizer=_no_moe_groups,
            is_moe_param=lambda param: False),
        "deepspeed.moe.layer": _package("deepspeed.moe.layer",
                                        MoE=_not_here("deepspeed.moe.layer.MoE",
                                                      "Mixture-of-Experts")),
        # Importable, refused when used (absent.py): pipeline classes, op builders,
        # DeepSpeed's optimizer types and other internals, offload enums and configs,
        # the memory-efficient linear, version info; the leaf-module defaults and the
        # torch_autocast dtype readers, which work.
        **absent.namespaces(_package, DEEPSPEED_VERSION),
    }


def _no_moe_groups(param_groups: Any, max_group_size: Any = None) -> Any:
    """DeepSpeed splits expert parameters into groups of their own; zeropp models
    have no expert parameters (deepspeed.moe.layer.MoE is refused), so the groups
    come back as they are (as a list, as DeepSpeed returns them)."""
    if isinstance(param_groups, dict):
        return [param_groups]
    return list(param_groups) if isinstance(param_groups, (list, tuple)) else param_groups


def _not_here(name: str, what: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"zeropp: {name} ({what}) is not part of zeropp")
    return refuse
