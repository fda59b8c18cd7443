"""DeepSpeed's own ZeRO-3 unit tests against `zeropp.install_as_deepspeed()`.

Not part of `make test`: a full run takes the better part of an hour on two cores.

    python benchmarks/conformance/ds_conformance.py --python /work/dsvenv/bin/python \
        --out /tmp/ds_conformance.md

What it does
- Takes DeepSpeed's tests from `--deepspeed PATH`: a checkout (PATH/tests/unit is used in
  place, read only) or a git directory (`git archive HEAD tests` into a temp folder). The
  default is the DeepSpeed snapshot at edaa722 kept in /work/.mirror.
- Runs each test file with `--python`'s pytest, in a new session so that a hang is killed
  with every child (DistributedTest's forkserver and pool workers). That interpreter's
  environment must have zeropp, torch, pytest 8.3 (as DeepSpeed pins it: <8.4) and
  DeepSpeed's small test deps (hjson, py-cpuinfo, psutil, ...), and must NOT have
  DeepSpeed itself. `import deepspeed` answers with zeropp in the pytest process and in
  every worker process because a `sitecustomize.py` in a harness folder put first on
  PYTHONPATH installs a finder that calls `zeropp.install_as_deepspeed()` on the first
  `import deepspeed` (ZEROPP_DSCONF=1 turns it on; nothing is imported before that).
- DeepSpeed's launcher (tests/unit/common.py, DistributedTest) asks the accelerator for
  the device count in the pytest process and skips a world larger than that. DeepSpeed's
  CPU accelerator reads LOCAL_SIZE; zeropp's reads LOCAL_WORLD_SIZE (known gap). The
  harness sets LOCAL_SIZE=--local-size for the pytest process and, only there and only
  when zeropp's answer differs, makes device_count read LOCAL_SIZE (the report says so).
  LOCAL_WORLD_SIZE is not set: zeropp reads it as ranks per node in the workers.
- A harness pytest plugin writes one JSON line per event (collected ids, test start,
  each phase's outcome with the exception's text); a test that started and never
  finished (DeepSpeed's own "Test hanged, exiting" after DS_UNITTEST_TIMEOUT, or the
  per-file timeout) is a hang; the file is then run again without the tests already done
  and the hung one.
- Classifies every test (rules below, each with its reason) and writes a markdown
  report: a table per file, the files that fail to import with the missing name, and
  every zeropp gap with its one-line reason, grouped by cause.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

MIRROR = "/work/.mirror/deepspeedai+DeepSpeed/repo"

# The default files: those of tests/unit/runtime/zero, tests/unit/v1/zero and
# tests/unit/checkpoint whose tests run ZeRO-3 (a stage-3 config or zero.Init), less the
# files whose subject is a feature zeropp refuses (NVMe / Offload++ / offload_states,
# MiCS, AutoTP + pipeline universal checkpoints, universal checkpoint conversion) and three
# whose ZeRO-3 content is one parametrization or one private helper
# (checkpoint/test_lr_scheduler.py, v1/zero/test_zero_init_pg_contradiction.py,
# v1/zero/test_zero_activation_checkpoint_lifecycle.py). `--files all` runs all 48.
DEFAULT_FILES = [
    "unit/runtime/zero/test_unwrap_model.py",
    "unit/runtime/zero/test_zero_allreduce_fetch_params.py",
    "unit/runtime/zero/test_zero_autocast_mixed_dtype.py",
    "unit/runtime/zero/test_zero_config.py",
    "unit/runtime/zero/test_zero_context.py",
    "unit/runtime/zero/test_zero_context_ancestry.py",
    "unit/runtime/zero/test_zero_context_return.py",
    "unit/runtime/zero/test_zero_dynamic_class.py",
    "unit/runtime/zero/test_zero_grad_clip.py",
    "unit/runtime/zero/test_zero_hook_attribute_delegation.py",
    "unit/runtime/zero/test_zero_late_module_attach.py",
    "unit/runtime/zero/test_zero_leaf_module.py",
    "unit/runtime/zero/test_zero_linear_direct_init.py",
    "unit/runtime/zero/test_zero_nesting_init.py",
    "unit/runtime/zero/test_zero_tensor_fragment.py",
    "unit/runtime/zero/test_zeropp.py",
    "unit/v1/zero/test_zero.py",
    "unit/v1/zero/test_zero_autocast.py",
    "unit/v1/zero/test_zero_coalesce_grad_reduction.py",
    "unit/v1/zero/test_zero_functorch_linear.py",
    "unit/v1/zero/test_zero_hook_count_regression.py",
    "unit/v1/zero/test_zero_user_backward.py",
    "unit/checkpoint/test_zero_optimizer.py",
    "unit/checkpoint/test_convert_checkpoint.py",
]
ALL_DIRS = ["unit/runtime/zero", "unit/v1/zero", "unit/checkpoint"]

# ---- classification rules (reviewable: first match wins, each with its reason) ------------

# zeropp's one-line refusals (src/zeropp/deepspeed/config.py, compat.py, alias.py,
# accelerator.py, zeropp/config.py): (pattern, what was refused).
REFUSED = [
    (r"allowed: 3 \(zeropp is ZeRO stage 3\)", "ZeRO stage 0-2"),
    (r"zeropp has no ZeRO-Offload", "ZeRO-Offload"),
    (r"op builders are not part", "compiled ops (op builders)"),
    (r"\(([^()]*)\) is not part of zeropp", None),  # what: the parenthesis
    (r"is not part of zeropp", "a DeepSpeed feature"),
    (r"model parallelism \(mpu, mesh_param\) is not supported", "model parallelism"),
    (r"DeepSpeed config: [\w.]+(=\S+)? is not supported", "a config feature"),
    (r"zeropp[\w. ]*: .* is not supported", "a DeepSpeed feature"),
]

# The test reaches into DeepSpeed's private implementation: (pattern on the failure's
# text, reason). Matched against the exception's text (and traceback) only.
INTERNAL = [
    (r"DeepSpeedZeroOptimizer_Stage3|stage3\.py|deepspeed\.runtime\.zero\.stage3",
     "DeepSpeed's ZeRO-3 optimizer class (DeepSpeedZeroOptimizer_Stage3) and its module"),
    (r"stage_1_and_2|DeepSpeedZeroOptimizer\b|BF16_Optimizer|FP16_Optimizer|bf16_optimizer",
     "DeepSpeed's stage 1/2 / fp16 / bf16 optimizer classes"),
    (r"has no attribute '(ds_tensor|ds_id|ds_grads_remaining|ds_persist|ds_active_sub_modules|"
     r"ds_secondary_tensor|ds_z3_leaf_module|ds_summary|ds_process_group|ds_param_alias)'",
     "a ZeRO-3 parameter's private partition bookkeeping (ds_tensor, ds_id, ...)"),
    (r"has no attribute '_\w+'", "a private attribute (leading underscore)"),
    (r"'Parameter' object has no attribute '(all_gather_coalesced|all_gather|partition|"
     r"partition_numel|padding_size|ds_summary|convert_to_zero_parameters|aligned_size)'",
     "a ZeRO-3 parameter's DeepSpeed-internal methods (all_gather_coalesced, partition, ...); "
     "the public way is deepspeed.zero.GatheredParameters"),
    (r"has no attribute '(fp32_partitioned_groups_flat|averaged_gradients|"
     r"fp16_partitioned_groups|ipg_\w+|param_coordinator|parameter_offload|"
     r"partition_count|bit16_groups|single_partition_of_fp32_groups|"
     r"get_param_coordinator|optimizer_swapper|__param_\w+|zero_grad_hook_count\w*|"
     r"reduce_ready_partitions_and_remove_grads|_?independent_gradient_partition_\w*|"
     r"fp32_groups_flat\w*|grad_position|params_in_partition|fp16_groups)'",
     "the engine's / optimizer's internal buffers and coordinators"),
    (r"partition_parameters has no attribute '(print_rank_0|\w+)'|"
     r"(CUDAQuantizer|MultipleAllGatherHandles|InsertPostInitMethodToModuleSubClasses|"
     r"DeepSpeedZeroConfig)('>)? has no attribute",
     "DeepSpeed-internal classes and helpers the test monkeypatches or builds directly "
     "(partition_parameters' print_rank_0 / Init._partition_param_sec, CUDAQuantizer's "
     "kernel module, the pydantic DeepSpeedZeroConfig)"),
    (r"Expected RuntimeError: inputs with requires_grad=False is not supported for a leaf",
     "expects DeepSpeed's own limitation (a RuntimeError for a leaf module's input that does "
     "not require grad, which its leaf hooks need); zeropp runs such inputs"),
    (r"baseline issued no collectives",
     "counts DeepSpeed's own comm primitives (deepspeed.comm.reduce_scatter_fn, all_reduce) "
     "by patching them; zeropp's engine reduces through its own collectives"),
    (r"deepspeed\.runtime\.zero\.(partitioned_param_coordinator|parameter_offload|"
     r"partitioned_param_swapper|linear|tiling|utils|mics|offload_states)",
     "a DeepSpeed-internal ZeRO module"),
]

# The alias's refusal of a DeepSpeed-internal name (absent.py: classes, functions a test
# builds or calls directly): internal, the parenthesis is the reason. Checked first.
INTERNAL_NAME = r"zeropp: ([\w.]+) is DeepSpeed-internal \(([^()]*)\)"

# A failure on a line of the test that uses a refused feature's objects (an assert that
# DeepSpeed's memory-efficient linear replaced F.linear, ...): (pattern on that line, what).
REFUSED_LINES = [
    (r"zero3_linear_wrap|linear_bk|LinearFunctionForZeroStage3",
     "DeepSpeed's memory-efficient linear; zeropp runs torch's F.linear"),  # absent.py's words
]

# A bare `assert` on DeepSpeed's internals: (pattern on the asserted source line, reason).
INTERNAL_ASSERTS = [
    (r"\bds_id\b", "DeepSpeed's per-parameter id (ds_id) as the mark of a partitioned param"),
    (r"convert_to_zero_parameters|all_gather_coalesced",
     "a ZeRO-3 parameter's DeepSpeed-internal methods (convert_to_zero_parameters, ...)"),
    (r"\bds_tensor\b|\bds_grads_remaining\b|\bds_persist\b",
     "a ZeRO-3 parameter's private partition bookkeeping (ds_tensor, ...)"),
    (r"ZeROOrderedDict|_parameters\b", "DeepSpeed's ZeROOrderedDict / a module's _parameters"),
    (r"pre_bwd_fn|post_bwd_fn|_backward_hooks|__dict__",
     "the implementation of DeepSpeed's ZeRO-3 module hooks (wrapper attributes)"),
    (r"\.optimizer\.\w+|engine\.optimizer\b",
     "the engine's optimizer object (DeepSpeed's ZeRO optimizer class)"),
    (r"\b_\w+\(|\._\w+", "a private attribute (leading underscore)"),
]

# Skips and failures that come from the machine having no CUDA device.
CUDA_ONLY = [
    r"only supported in accelerator environments", r"[Cc][Uu][Dd][Aa]", r"\bGPU", r"NCCL",
    r"fp16 is not supported", r"[Hh]alf.*not supported", r"float16.*not supported",
    r"bf16 is not supported", r"[Bb][Ff]16.*not supported", r"not enough GPUs",
    r"[Aa]ccelerator.*not (support|available)", r"requires? (a )?(cuda|gpu|accelerator)",
    r"xpu|hpu|npu|ROCm|rocm",
]

# Failures that come from the machine having no CUDA device (matched on the exception line).
CUDA_FAIL = [
    r"Torch not compiled with CUDA", r"CUDA (is not available|driver)", r"no CUDA GPUs",
    r"NCCL", r"cuda(:\d)?\b.*(not available|unavailable)",
    # unit/common.py's reduce_boolean_flags puts a tensor on current_device(): DeepSpeed's
    # own CPU accelerator answers LOCAL_RANK there, which torch refuses as a device too.
    r"Cannot access accelerator device when none is available|Invalid device string: '\d+'",
    # a DDP baseline built with device_ids=[rank]: GPU modules only
    r"DistributedDataParallel device_ids and output_device arguments only work with",
    # the test's own bf16 check raising (not skipping) without NCCL / CUDA
    r"DeepSpeed BFloat16 tests need torch",
]

# A whole file fails to import: the missing module or name.
MISSING = [
    r"No module named '([\w.]+)'",
    r"cannot import name '(\w+)' from '([\w.]+)'",
    r"module '([\w.]+)' has no attribute '(\w+)'",
]

NOT_HERE_MARK = "is not part of zeropp"

# ---- harness files written beside the run --------------------------------------------------

SITECUSTOMIZE = r'''
# zeropp ds_conformance harness: `import deepspeed` answers with zeropp in every process
# that has ZEROPP_DSCONF=1 (the pytest process and DistributedTest's workers).
import os, sys
if os.environ.get("ZEROPP_DSCONF") == "1":
    import importlib.abc
    # LOCAL_SIZE is for the pytest process (DistributedTest reads the device count there);
    # in a worker, only DeepSpeed's _dist_run sets it (as its launcher would), so a serial
    # test (set_dist_env = False) does not see 4 ranks per node in a world of 1.
    if os.environ.get("ZEROPP_DSCONF_PYTEST_PID", str(os.getpid())) != str(os.getpid()):
        os.environ.pop("LOCAL_SIZE", None)

    class _ZeroppAsDeepSpeed(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
                return None
            sys.meta_path.remove(self)
            import zeropp
            zeropp.install_as_deepspeed()
            from zeropp.deepspeed import alias
            if os.environ.get("ZEROPP_DSCONF_STUBLOG"):
                import zeropp_dsconf_stubs
                zeropp_dsconf_stubs.install()
                if fullname in sys.modules:
                    return sys.modules[fullname].__spec__
                return zeropp_dsconf_stubs._StubFinder().find_spec(fullname) \
                    or alias._finder.find_spec(fullname, path, target)
            return alias._finder.find_spec(fullname, path, target)

    sys.meta_path.insert(0, _ZeroppAsDeepSpeed())
'''

# --stub-missing (a probe, not the conformance result): every DeepSpeed module or name the
# alias lacks answers with a stub that logs the name; calling a stub raises
# NotImplementedError("harness stub: NAME ..."), so a test that needs the name fails there
# and the run shows what lies behind each file's first missing import.
STUBS = r'''
import os, sys, types, importlib.abc, importlib.machinery
_LOG = os.environ.get("ZEROPP_DSCONF_STUBLOG")
_SPECIAL = {"__path__", "__file__", "__spec__", "__all__", "__wrapped__", "__loader__",
            "__name__", "__package__", "__getattr__", "__dict__", "__class__", "__origin__",
            "__mro_entries__", "__signature__", "__code__", "__self__", "__func__",
            "__qualname__", "__module__", "__doc__", "__annotations__", "__bases__",
            "__set_name__", "__get__", "__len__", "__iter__", "__fspath__"}


def _not_stubbed(name):
    """Names Python and pytest probe for (fixtures, marks, dunders): not DeepSpeed's."""
    return (name in _SPECIAL or name.startswith(("_pytest", "pytest"))
            or (name.startswith("__") and name.endswith("__")
                and name not in ("__compatible_ops__", "__version__")))


def _log(kind, name):
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(f"{kind} {name}\n")


class _StubMeta(type):
    def __getattr__(cls, name):
        if _not_stubbed(name):
            raise AttributeError(name)
        return _stub(f"{cls._stub_name}.{name}")

    def __call__(cls, *a, **k):
        _log("call", cls._stub_name)
        raise NotImplementedError(f"harness stub: {cls._stub_name} is not in zeropp")

    def __getitem__(cls, key):
        return _stub(f"{cls._stub_name}[{key!r}]")

    def __bool__(cls):
        return False


def _stub(name):
    _log("name", name)
    return _StubMeta(name.rsplit(".", 1)[-1].split("[")[0] or "stub", (),
                     {"_stub_name": name, "__module__": "zeropp_dsconf_stubs"})


# A stub in a test's parameters travels to DistributedTest's workers by pickle: by name.
import copyreg
copyreg.pickle(_StubMeta, lambda cls: (_stub, (cls._stub_name,)))


def _module_getattr(modname):
    def __getattr__(name):
        if _not_stubbed(name):
            raise AttributeError(name)
        return _stub(f"{modname}.{name}")
    return __getattr__


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__getattr__ = _module_getattr(spec.name)
        return m

    def exec_module(self, module):
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("deepspeed.") or fullname in sys.modules:
            return None
        _log("module", fullname)
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


def install():
    for name, m in list(sys.modules.items()):
        if (name == "deepspeed" or name.startswith("deepspeed.")) and \
                "__getattr__" not in vars(m):
            m.__getattr__ = _module_getattr(name)
    sys.meta_path.insert(0, _StubFinder())
    # The probe also gets past the first gap every DistributedTest meets: DeepSpeed's
    # launcher calls init_distributed(init_method="file://...", rank=r, world_size=n),
    # and the alias's init_distributed does not pass rank / world_size on to torch.
    import functools
    import torch.distributed as tdist
    ds = sys.modules["deepspeed"]
    orig = ds.init_distributed

    @functools.wraps(orig)
    def init_distributed(*a, **k):
        if not tdist.is_initialized() and k.get("init_method") and k.get("rank", -1) >= 0:
            _log("probe", "init_distributed(rank, world_size) passed to torch")
            tdist.init_process_group(k.get("dist_backend") or "gloo",
                                     init_method=k["init_method"], rank=k["rank"],
                                     world_size=k["world_size"])
            return None
        return orig(*a, **k)
    ds.init_distributed = init_distributed
'''

PLUGIN = r'''
# zeropp ds_conformance harness plugin: one JSON line per event, flushed at once.
import json, os, sys, time
_f = open(os.environ["ZEROPP_DSCONF_EVENTS"], "a", buffering=1)


def _w(**kw):
    kw["t"] = round(time.time(), 2)
    _f.write(json.dumps(kw) + "\n")
    _f.flush()


def pytest_configure(config):
    os.environ["ZEROPP_DSCONF_PYTEST_PID"] = str(os.getpid())
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        acc = get_accelerator()
        ls = os.environ.get("LOCAL_SIZE")
        _w(ev="alias", deepspeed=getattr(deepspeed, "__file__", "?"),
           version=getattr(deepspeed, "__version__", "?"), accelerator=repr(acc))
        if ls and acc.device_name() == "cpu" and acc.device_count() != int(ls):
            cls = type(acc)
            orig = cls.device_count

            def device_count(self):
                v = os.environ.get("LOCAL_SIZE")
                return int(v) if v else orig(self)
            cls.device_count = device_count
            _w(ev="shim", what="accelerator.device_count reads LOCAL_SIZE (pytest process)")
    except BaseException as e:  # reported, the run goes on (collection will show it)
        _w(ev="alias_error", text=f"{type(e).__name__}: {e}")


def pytest_collection_modifyitems(session, config, items):
    # --sample N: at most N parametrizations of each test function, evenly spread
    n = int(os.environ.get("ZEROPP_DSCONF_SAMPLE", "0"))
    if n <= 0:
        return
    by = {}
    for it in items:
        by.setdefault(it.nodeid.split("[")[0], []).append(it)
    keep = set()
    for group in by.values():
        k = len(group)
        idx = {0} if n == 1 else {round(j * (k - 1) / (n - 1)) for j in range(min(n, k))}
        keep |= {id(group[i]) for i in idx}
    dropped = [it for it in items if id(it) not in keep]
    items[:] = [it for it in items if id(it) in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        _w(ev="sampled_out", ids=[it.nodeid for it in dropped])


def pytest_collection_finish(session):
    _w(ev="collected", ids=[i.nodeid for i in session.items])


def pytest_collectreport(report):
    if report.failed:
        _w(ev="collect_error", id=report.nodeid, text=report.longreprtext[-20000:])


def pytest_runtest_logstart(nodeid, location):
    _w(ev="start", id=nodeid)


def pytest_runtest_logreport(report):
    d = dict(ev="report", id=report.nodeid, when=report.when, outcome=report.outcome,
             dur=round(report.duration, 2))
    if hasattr(report, "wasxfail"):
        d["xfail"] = report.wasxfail or "xfail"
    if report.skipped and isinstance(report.longrepr, tuple):
        d["reason"] = str(report.longrepr[2])
    elif report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        d["crash"] = crash.message if crash is not None else ""
        d["text"] = report.longreprtext[-30000:]
    _w(**d)


def pytest_runtest_logfinish(nodeid, location):
    _w(ev="finish", id=nodeid)
'''


# ---- running --------------------------------------------------------------------------------

def prepare_tests(src: str, work: Path) -> Path:
    p = Path(src)
    if (p / "tests" / "unit" / "common.py").exists():
        return p / "tests"
    dest = work / "ds"
    dest.mkdir(parents=True, exist_ok=True)
    arch = subprocess.run(["git", "-C", str(p), "archive", "HEAD", "tests"],
                          capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=arch, check=True)
    return dest / "tests"


def ds_commit(src: str) -> str:
    try:
        return subprocess.run(["git", "-C", src, "rev-parse", "--short=9", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "?"


_CHILD: list = [None]  # the pytest now running (its own session): ended with the driver


def _on_term(signum, frame):
    if _CHILD[0] is not None:
        kill_group(_CHILD[0])
    sys.exit(128 + signum)


def kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def read_events(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def run_file(a, tests: Path, harness: Path, rel: str, logdir: Path) -> dict:
    """Runs one file, again without the done tests after each hang. Returns its events."""
    stem = rel.replace("/", "__")
    events: list[dict] = []
    done: set[str] = set()
    hangs: list[str] = []
    collected: list[str] = []
    start = time.time()
    for attempt in range(a.max_restarts + 1):
        evpath = logdir / f"{stem}.{attempt}.jsonl"
        evpath.unlink(missing_ok=True)
        env = dict(os.environ)
        env.update(ZEROPP_DSCONF="1", ZEROPP_DSCONF_EVENTS=str(evpath),
                   PYTHONPATH=os.pathsep.join([str(harness), str(tests)]
                                              + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
                   DS_ACCELERATOR="cpu", LOCAL_SIZE=str(a.local_size),
                   DS_UNITTEST_TIMEOUT=str(a.test_timeout), OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        env.pop("LOCAL_WORLD_SIZE", None)
        stublog = logdir / f"{stem}.{attempt}.stubs"
        stublog.unlink(missing_ok=True)
        if a.stub_missing:
            env["ZEROPP_DSCONF_STUBLOG"] = str(stublog)
        if a.sample:
            env["ZEROPP_DSCONF_SAMPLE"] = str(a.sample)
        cmd = [a.python, "-m", "pytest", rel, "-v", "-rA", "-p", "no:cacheprovider",
               "-p", "zeropp_dsconf_plugin", "--color=no", "-W", "ignore::DeprecationWarning"]
        for nid in sorted(done | set(hangs)):
            cmd += ["--deselect", nid]
        budget = a.file_timeout - (time.time() - start)
        if budget < 30:
            break
        with open(logdir / f"{stem}.{attempt}.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            _CHILD[0] = proc
            timed_out = False
            try:
                proc.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                timed_out = True
            kill_group(proc)  # also ends a forkserver or pool left behind
        evs = read_events(evpath)
        if stublog.exists():
            evs.append(dict(ev="stubs", lines=sorted(set(stublog.read_text().splitlines()))))
        for e in evs:
            e["attempt"] = attempt
        events += evs
        if not collected:
            collected = next((e["ids"] for e in evs if e["ev"] == "collected"), [])
        started = [e["id"] for e in evs if e["ev"] == "start"]
        finished = {e["id"] for e in evs if e["ev"] == "finish"}
        done |= finished
        hung = [i for i in started if i not in finished]
        if hung:
            hangs.append(hung[-1])
            ran = time.time() - next((e["t"] for e in evs if e["ev"] == "start"
                                      and e["id"] == hung[-1]), time.time())
            events.append(dict(ev="hang", id=hung[-1], timed_out=timed_out, attempt=attempt,
                               cut=timed_out and ran < a.test_timeout))
        elif timed_out:  # killed before a test started (collection or startup hung)
            events.append(dict(ev="file_timeout", attempt=attempt))
            break
        left = [i for i in collected if i not in done and i not in hangs]
        if not hung or not left:
            break
    events.append(dict(ev="file_done", wall=round(time.time() - start, 1)))
    return {"file": rel, "events": events, "collected": collected,
            "test_timeout": a.test_timeout}


# ---- classification ------------------------------------------------------------------------

def first_match(rules, text):
    for pat, reason in rules:
        m = re.search(pat, text)
        if m:
            return m, reason
    return None, None


def last_line(text: str) -> str:
    """The exception's one line: the last `E   Type: msg` line, else the crash message."""
    lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    exc = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt|Failed|"
                                          r"Warning)\b|^assert |^AssertionError", ln)]
    pick = exc[-1] if exc else (lines[-1] if lines else text.strip().splitlines()[-1:] or [""])
    if isinstance(pick, list):
        pick = pick[0] if pick else ""
    return pick[:400]


def remote_lines(text: str) -> str:
    """The last worker-side exception line in a RemoteTraceback, if any."""
    m = re.findall(r'"""\n(?:.*\n)*?(\w[\w.]*(?:Error|Exception)[^\n]*)\n"""', text)
    return m[-1][:400] if m else ""


def where(text: str) -> str:
    """The last frame in DeepSpeed's test tree: `unit/x.py:N: code`."""
    frames = re.findall(r'File "[^"]*?(unit/[\w/]+\.py)", line (\d+), in \w+\n\s+([^\n]*)', text)
    if frames:
        f, n, code = frames[-1]
        return f"{f}:{n}: {code.strip()[:200]}"
    frames = re.findall(r"\n(\S*?(unit/[\w/]+\.py):(\d+): (?:in \w+|\w+))", text)
    if frames:
        _, f, n = frames[-1]
        src = re.findall(r"\n>\s+([^\n]+)", text)
        return f"{f}:{n}" + (f": {src[-1].strip()[:200]}" if src else "")
    return ""


def classify_failure(text: str, crash: str) -> tuple[str, str]:
    """(category, detail) for a failed test. Matched against the exception's lines only
    (pytest's traceback also prints the test's source, which names internals the failure
    may have nothing to do with)."""
    hay = "\n".join((crash, remote_lines(text), last_line(text)))
    m = re.search(r"harness stub: (\S+) is not in zeropp", hay)
    if not m and ("zeropp_dsconf_stub" in hay or "_StubMeta" in hay):  # a stub used as a value
        return "stub", "(a stubbed value in the test's parameters: " + \
            (re.findall(r"zeropp_dsconf_stubs?\.(\w+)", hay) or ["a value"])[0] + ")"
    if m:
        name = m.group(1)
        m2, reason = first_match(INTERNAL, name)
        if m2 or name.rsplit(".", 1)[-1].startswith("_"):
            return "internal", reason or "a private name (leading underscore)"
        return "stub", name
    m = re.search(INTERNAL_NAME, hay)
    if m:
        return "internal", f"DeepSpeed-internal {m.group(1)}: {m.group(2)}"
    m, what = first_match(REFUSED, hay)
    if m:
        what = what or m.group(1)
        return "refused", what
    m, what = first_match(REFUSED_LINES, where(text))
    if m:
        return "refused", what
    m, reason = first_match(INTERNAL, hay)
    if m:
        return "internal", reason
    if re.search(r"^AssertionError\s*$|^(AssertionError: )?assert ", last_line(text), re.M):
        # a bare assert: what it checked is the test's source line
        m, reason = first_match(INTERNAL_ASSERTS, where(text))
        if m:
            return "internal", reason
    for pat in CUDA_FAIL:
        if re.search(pat, hay):
            return "cuda-only", crash[:200]
    return "gap", ""


def classify_skip(reason: str) -> str:
    return "cuda-only" if any(re.search(p, reason) for p in CUDA_ONLY) else "skipped"


def refused_feature(text: str) -> str:
    """The feature zeropp refuses that an import failure names ("" if none): the alias's
    ModuleNotFoundError for a module it leaves out, or a refusal raised at import."""
    m = re.search(r"\(([^()]*) is not part of zeropp\)", text)
    if m:
        return m.group(1)
    m, what = first_match(REFUSED, last_line(text))
    return (what or m.group(1)) if m else ""


def missing_name(text: str) -> str:
    for pat in MISSING:
        ms = list(re.finditer(pat, text))
        if ms:
            return ".".join(reversed(ms[-1].groups())) if "cannot import" in pat else \
                ".".join(ms[-1].groups())
    return last_line(text)


def import_chain(text: str, tests: str) -> str:
    """The DeepSpeed test-tree files in the import traceback (the last one did the import)."""
    files = re.findall(r'(?:^|\n)(?:\s*File ")?([\w./-]*unit/[\w./-]+\.py)"?[,:]', text)
    out = []
    for f in files:
        f = f[f.find("unit/"):]
        if not out or out[-1] != f:
            out.append(f)
    return " -> ".join(out[-3:])


def summarize(run: dict) -> dict:
    rel = run["file"]
    evs = run["events"]
    res: dict[str, dict] = {}
    tests = {}
    for e in evs:
        if e["ev"] == "start":
            tests.setdefault(e["id"], {"phases": []})
        elif e["ev"] == "report":
            tests.setdefault(e["id"], {"phases": []})["phases"].append(e)
    # A test still running when the per-file timeout struck, for less than DeepSpeed's own
    # hang limit (DS_UNITTEST_TIMEOUT), was cut off, not hung: it counts as not run.
    limit = run.get("test_timeout", 240)
    starts = {(e["id"], e.get("attempt")): e.get("t", 0) for e in evs if e["ev"] == "start"}
    t_end = {}
    for e in evs:
        if "t" in e:
            t_end[e.get("attempt")] = max(t_end.get(e.get("attempt"), 0), e["t"])
    cut = {e["id"] for e in evs if e["ev"] == "hang" and e.get("timed_out")
           and e.get("cut", (run.get("killed_at", {}).get(str(e["attempt"]),
                                                          t_end.get(e["attempt"], 0))
                             - starts.get((e["id"], e["attempt"]), 0)) < limit)}
    hangs = [e["id"] for e in evs if e["ev"] == "hang" and e["id"] not in cut]
    collect_errors = [e for e in evs if e["ev"] == "collect_error"]
    stubbed = sorted({ln.split(" ", 1)[1].split("[")[0] for e in evs if e["ev"] == "stubs"
                      for ln in e["lines"] if ln.startswith(("name ", "module "))
                      and "_pytest" not in ln}, key=len, reverse=True)
    for tid in cut:
        tests.pop(tid, None)
    for tid, t in tests.items():
        if tid in hangs:
            res[tid] = {"cat": "hang", "line": "no result within the timeout; killed"}
            continue
        ph = t["phases"]
        failed = [p for p in ph if p["outcome"] == "failed"]
        skipped = [p for p in ph if p["outcome"] == "skipped"]
        if failed:
            p = next((p for p in failed if p["when"] == "call"), failed[0])
            text, crash = p.get("text", ""), p.get("crash", "")
            cat, detail = classify_failure(text, crash)
            code = where(text)
            if cat == "gap" and stubbed:  # the failing line uses a stubbed name (probe)
                hit = next((n for n in stubbed if re.search(
                    r"\b" + re.escape(n.rsplit(".", 1)[-1]) + r"\b", code)), None)
                if hit:
                    cat, detail = "stub", hit
            line = remote_lines(text) or last_line(text) or crash
            if re.fullmatch(r"(AssertionError|assert .*|AssertionError: assert .*)", line):
                line = f"{line} at {where(text)}"
            if p["when"] != "call":
                line = f"[{p['when']}] {line}"
            res[tid] = {"cat": cat, "detail": detail, "line": line, "text": text,
                        "where": where(text)}
        elif skipped:
            r = skipped[0].get("reason") or skipped[0].get("xfail", "")
            if skipped[0].get("xfail"):
                res[tid] = {"cat": "skipped", "line": f"xfail: {skipped[0]['xfail']}"}
            else:
                res[tid] = {"cat": classify_skip(r), "line": r}
        elif any(p["when"] == "call" and p["outcome"] == "passed" for p in ph):
            res[tid] = {"cat": "passed"}
        else:
            res[tid] = {"cat": "hang", "line": "started, never reported (process ended)"}
    notrun = [i for i in run["collected"] if i not in res]
    sampled = sorted({i for e in evs if e["ev"] == "sampled_out" for i in e["ids"]})
    imp = None
    if collect_errors and not tests:
        text = collect_errors[0]["text"]
        name = missing_name(text)
        feature = refused_feature(text)
        chain = import_chain(text, rel)
        direct = chain.split(" -> ")[-1] == rel if chain else True
        imp = {"missing": name, "refused": bool(feature) or NOT_HERE_MARK in text,
               "feature": feature, "chain": chain, "direct": direct, "line": last_line(text)}
    alias_err = [e["text"] for e in evs if e["ev"] == "alias_error"]
    stubs = sorted({ln for e in evs if e["ev"] == "stubs" for ln in e["lines"]})
    shim = any(e["ev"] == "shim" for e in evs)
    wall = next((e["wall"] for e in evs if e["ev"] == "file_done"), 0)
    return {"file": rel, "tests": res, "notrun": notrun, "import": imp, "wall": wall,
            "alias_error": alias_err, "shim": shim, "stubs": stubs, "sampled": sampled,
            "file_timeout": any(e["ev"] == "file_timeout" for e in evs)}


COLS = ["passed", "refused", "internal", "cuda-only", "skipped", "gap", "hang"]
STUB_COLS = COLS[:-2] + ["stub", "gap", "hang"]


def gap_cause(g: dict) -> str:
    """A grouping key: the exception line with numbers, names in quotes and paths blurred."""
    line = g["line"]
    line = re.sub(r"\[[^\]]*\]$", "", line)
    line = re.sub(r"0x[0-9a-f]+", "0x…", line)
    line = re.sub(r"\b\d+(\.\d+)?(e-?\d+)?\b", "N", line)
    line = re.sub(r"tensor\(.*", "tensor(…)", line)
    return line[:160]


def report(a, sums: list[dict], ds_rev: str, elapsed: float) -> str:
    out = []
    cmd = " ".join([Path(sys.executable).name if False else "python",
                    "benchmarks/conformance/ds_conformance.py"] + sys.argv[1:])
    out.append(f"DeepSpeed tests @ {ds_rev}, zeropp @ {zeropp_rev()}, {len(sums)} files, "
               f"run in {elapsed / 60:.0f} min on CPU (DS_ACCELERATOR=cpu, LOCAL_SIZE={a.local_size}, "
               f"DS_UNITTEST_TIMEOUT={a.test_timeout} s, per-file timeout {a.file_timeout} s).\n")
    out.append(f"Command: `{cmd}`\n")
    if any(s["shim"] for s in sums):
        out.append("Harness shim used: zeropp's CPU accelerator's device_count() read "
                   "LOCAL_WORLD_SIZE, not DeepSpeed's LOCAL_SIZE, so in the pytest process it "
                   "was made to read LOCAL_SIZE (otherwise every 2-rank test skips).\n")
    cols = STUB_COLS if a.stub_missing else COLS
    if a.stub_missing:
        out.append("**Probe mode (--stub-missing)**: every DeepSpeed module or name the alias "
                   "lacks was a harness stub; `stub` counts the tests that called one (a gap: "
                   "the name is missing), `gap` the other failures behind them. The probe also passes "
                   "init_distributed's rank / world_size on to torch (the first gap of every "
                   "DistributedTest).\n")
    out.append("| file | tests | " + " | ".join(cols) + " | import |")
    out.append("|---|---|" + "---|" * len(cols) + "---|")
    tot = Counter()
    for s in sums:
        c = Counter(t["cat"] for t in s["tests"].values())
        n = len(s["tests"]) + len(s["notrun"])
        tot.update(c)
        tot["tests"] += n
        if s["import"]:
            i = s["import"]
            kind = "FAILS"
            if i["refused"]:  # the file imports a refused feature at module level
                kind = f"refused ({i.get('feature') or 'a DeepSpeed feature'})"
                tot["import_refused"] += 1
            imp = f"{kind}: `{i['missing']}`" + (f" via {i['chain']}" if not i["direct"] else "")
            tot["import_fail"] += 1
        else:
            imp = "ok"
        extra = f" (+{len(s['notrun'])} not run)" if s["notrun"] else ""
        if s.get("sampled"):
            extra += f" (+{len(s['sampled'])} sampled out)"
            tot["sampled"] += len(s["sampled"])
        out.append(f"| {s['file'].replace('unit/', '')} | {n}{extra} | "
                   + " | ".join(str(c.get(k, 0)) for k in cols) + f" | {imp} |")
    out.append(f"| **all {len(sums)} files** | {tot['tests']}"
               + (f" (+{tot['sampled']} sampled out)" if tot["sampled"] else "") + " | "
               + " | ".join(f"**{tot.get(k, 0)}**" for k in cols)
               + f" | {tot['import_fail']} fail"
               + (f" ({tot['import_refused']} on a refused feature)" if tot["import_refused"]
                  else "") + " |")
    out.append("")
    imps = [s for s in sums if s["import"]]
    if imps:
        out.append("### Files that fail to import\n")
        for s in imps:
            i = s["import"]
            out.append(f"- `{s['file']}`: `{i['missing']}`"
                       + (f" (imported by {i['chain']})" if i["chain"] else "")
                       + (f" — imports {i.get('feature') or 'a feature zeropp refuses'}, "
                          "which zeropp refuses, at module level" if i["refused"]
                          else " — a zeropp gap")
                       + f"\n  `{i['line']}`")
        out.append("")
    gaps = [(s["file"], tid, t) for s in sums for tid, t in s["tests"].items() if t["cat"] == "gap"]
    hangs = [(s["file"], tid, t) for s in sums for tid, t in s["tests"].items() if t["cat"] == "hang"]
    if hangs:
        out.append("### Hangs\n")
        out += [f"- `{tid}`: {t['line']}" for _, tid, t in hangs]
        out.append("")
    out.append(f"### zeropp gaps ({len(gaps)}), grouped by exception line, most frequent first\n")
    groups = defaultdict(list)
    for _f, tid, t in gaps:
        groups[gap_cause(t)].append((tid, t))
    for cause, items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        out.append(f"- **{len(items)}×** `{cause}`")
        for tid, t in items:
            at = f" ({t['where']})" if t.get("where") and t["where"] not in t["line"] else ""
            out.append(f"  - `{tid}`: `{t['line']}`{at}")
    out.append("")
    if a.stub_missing:
        out.append("### Stubbed names: tests that called each (module-level use in parentheses)\n")
        calls = Counter(t["detail"].split("[")[0] for s in sums for t in s["tests"].values()
                        if t["cat"] == "stub")
        used = defaultdict(set)
        for s in sums:
            for ln in s["stubs"]:
                kind, _, name = ln.partition(" ")
                name = name.split("[")[0]
                if kind in ("module", "name") and "_pytest" not in name:
                    used[name].add(s["file"].replace("unit/", ""))
        for name in sorted(set(calls) | set(used), key=lambda n: (-calls.get(n, 0), n)):
            out.append(f"- `{name}`: {calls.get(name, 0)} tests"
                       + (f" (files: {', '.join(sorted(used[name]))})" if name in used else ""))
        out.append("")
    for cat in ("refused", "internal", "cuda-only", "skipped"):
        items = [(tid, t) for s in sums for tid, t in s["tests"].items() if t["cat"] == cat]
        if items:
            out.append(f"### {cat} ({len(items)}), by reason\n")
            by = Counter((t.get("detail") or t.get("line") or "")[:160] for _, t in items)
            for d, n in by.most_common():
                ex = next(tid for tid, t in items
                          if (t.get("detail") or t.get("line") or "")[:160] == d)
                out.append(f"- {n}× {d} (e.g. `{ex}`)")
            out.append("")
    return "\n".join(out)


def zeropp_rev() -> str:
    try:
        here = Path(__file__).resolve().parent
        return subprocess.run(["git", "-C", str(here), "rev-parse", "--short=7", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deepspeed", default=MIRROR, help="DeepSpeed checkout or git dir")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter with zeropp, torch, pytest<8.4, no DeepSpeed")
    ap.add_argument("--files", nargs="*", default=None,
                    help="test files relative to tests/ (default: the 24; 'all': 48)")
    ap.add_argument("--out", required=True, help="markdown report to write")
    ap.add_argument("--workdir", default=None, help="logs and extracted tests (default: temp)")
    ap.add_argument("--local-size", type=int, default=4)
    ap.add_argument("--test-timeout", type=int, default=240,
                    help="DS_UNITTEST_TIMEOUT: DeepSpeed's own per-test hang limit (s)")
    ap.add_argument("--file-timeout", type=int, default=1800, help="per file, all attempts (s)")
    ap.add_argument("--max-restarts", type=int, default=4, help="re-runs of a file after hangs")
    ap.add_argument("--sample", type=int, default=0,
                    help="run at most N parametrizations of each test function (0: all)")
    ap.add_argument("--resummarize", action="store_true",
                    help="only write --out again from --workdir's logs")
    ap.add_argument("--stub-missing", action="store_true",
                    help="probe: stub every DeepSpeed name the alias lacks (not the result)")
    a = ap.parse_args(argv)

    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="ds_conformance_"))
    work.mkdir(parents=True, exist_ok=True)
    harness = work / "harness"
    harness.mkdir(exist_ok=True)
    (harness / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (harness / "zeropp_dsconf_plugin.py").write_text(PLUGIN)
    (harness / "zeropp_dsconf_stubs.py").write_text(STUBS)
    logdir = work / "logs"
    logdir.mkdir(exist_ok=True)
    tests = prepare_tests(a.deepspeed, work)
    chk = subprocess.run([a.python, "-c", "import importlib.util as u, sys; "
                          "sys.exit(u.find_spec('deepspeed') is not None)"])
    if chk.returncode != 0:
        sys.exit(f"{a.python}: the real DeepSpeed is importable; use an environment without it")
    if a.resummarize:  # the report again from a finished run's logs (rules changed)
        runs = [json.loads(p.read_text()) for p in logdir.glob("*.run.json")]
        order = {f: i for i, f in enumerate(DEFAULT_FILES)}
        runs.sort(key=lambda r: (order.get(r["file"], len(order)), r["file"]))
        sums = [summarize(r) for r in runs]
        Path(a.out).write_text(report(a, sums, ds_commit(a.deepspeed),
                                      sum(s["wall"] for s in sums)))
        print(f"wrote {a.out} from {len(sums)} files in {logdir}")
        return 0
    files = a.files or DEFAULT_FILES
    if files == ["all"]:
        files = sorted(str(p.relative_to(tests)) for d in ALL_DIRS
                       for p in (tests / d).glob("test_*.py"))
    t0 = time.time()
    sums = []
    for rel in files:
        t1 = time.time()
        run = run_file(a, tests, harness, rel, logdir)
        (logdir / (rel.replace("/", "__") + ".run.json")).write_text(json.dumps(run))
        s = summarize(run)
        sums.append(s)
        c = Counter(t["cat"] for t in s["tests"].values())
        print(f"{rel}: {dict(c)}" + (f" import: {s['import']['missing']}" if s["import"] else "")
              + f" ({time.time() - t1:.0f} s)", flush=True)
        Path(a.out).write_text(report(a, sums, ds_commit(a.deepspeed), time.time() - t0))
    print(f"wrote {a.out}; logs in {logdir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
