"""Offline stand-ins for the public DeepSpeed scripts that benchmarks/conformance/public_scripts.py
runs unmodified (data sets, tokenizers and small tools they import that cannot answer
without a network here). Each is installed only for a module the script imports and
only where the real package cannot answer offline.

  torchvision   when torchvision is missing or ./data has no CIFAR-10: a module with
                datasets.CIFAR10 = a synthetic, learnable CIFAR of the same shape
                (3x32x32 in [0, 1], 10 classes, 256 train / 64 test, each class a fixed
                random prototype + noise, identical on every rank) and minimal
                transforms.Compose / ToTensor (identity on tensors) / Normalize.
  datasets      `load_dataset` tries the real one first (offline); on failure
                "wikitext" becomes 2,000 synthetic lines that count up through a
                200-word vocabulary ("w17 w18 ...", every 10th line empty), so masked
                words follow from their neighbours and the MLM loss can fall. A
                minimal Dataset (from_dict / filter / map) if `datasets` is missing.
  transformers  `AutoTokenizer.from_pretrained` tries the real one first; on OSError
                (not cached, offline) an offline word-level PreTrainedTokenizerFast with
                RoBERTa's special ids (<s>=0 <pad>=1 </s>=2 <unk>=3) and those 200 words.
  fire, loguru, torch.utils.tensorboard (tensorboard), sh, pytz: only when not installed.
                fire: Fire(fn) with --name value / --name=value (Python literals);
                loguru: logger -> logging; tensorboard: a no-op SummaryWriter;
                sh: git.log / git.diff raise ErrorReturnCode_128 / _129 (the script's
                own "not in a git repo" branch); pytz: a UTC timezone whose now() is the
                launcher's start time, so every rank of one launch computes the same
                experiment directory name (the wall clock can straddle a second
                between ranks; with a real pytz that race remains).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import random
import sys
import time
import types
from pathlib import Path

TAG = "[public_scripts]"


def _module(name: str, **attrs):
    m = types.ModuleType(name, f"offline stand-in installed by {__file__}")
    m.__dict__.update(attrs)
    sys.modules[name] = m
    parent, _, leaf = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], leaf, m)
    return m


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _standin_torchvision() -> str:
    """torchvision with a synthetic CIFAR10 (see the module docstring)."""
    import torch

    class CIFAR10(torch.utils.data.Dataset):
        def __init__(self, root=None, train=True, download=False, transform=None,
                     target_transform=None):
            n, g = (256 if train else 64), torch.Generator().manual_seed(0)
            protos = torch.rand(10, 3, 32, 32, generator=g)
            g.manual_seed(1 if train else 2)
            self.targets = (torch.randperm(n, generator=g) % 10).tolist()
            self.data = 0.75 * protos[self.targets] + 0.25 * torch.rand(n, 3, 32, 32, generator=g)
            self.transform, self.target_transform = transform, target_transform

        def __len__(self):
            return len(self.targets)

        def __getitem__(self, i):
            x, y = self.data[i], self.targets[i]
            x = self.transform(x) if self.transform else x
            return x, (self.target_transform(y) if self.target_transform else y)

    class Compose:
        def __init__(self, transforms):
            self.transforms = transforms

        def __call__(self, x):
            for t in self.transforms:
                x = t(x)
            return x

    class ToTensor:
        def __call__(self, x):
            return x  # the synthetic images already are float tensors in [0, 1]

    class Normalize:
        def __init__(self, mean, std):
            self.mean, self.std = (torch.tensor(v).view(-1, 1, 1) for v in (mean, std))

        def __call__(self, x):
            return (x - self.mean) / self.std

    _module("torchvision")
    _module("torchvision.datasets", CIFAR10=CIFAR10)
    _module("torchvision.transforms", Compose=Compose, ToTensor=ToTensor, Normalize=Normalize)
    return "torchvision (synthetic CIFAR10 256/64)"


WORDS = [f"w{i}" for i in range(200)]


def _wikitext_lines(n: int = 2000, seed: int = 0) -> list[str]:
    rng, lines = random.Random(seed), []
    for i in range(n):
        if i % 10 == 0:
            lines.append("")
            continue
        start, length = rng.randrange(len(WORDS)), rng.randrange(8, 40)
        lines.append(" ".join(WORDS[(start + k) % len(WORDS)] for k in range(length)) + "\n")
    return lines


def _standin_datasets() -> str:
    """`datasets.load_dataset`: the real one first, synthetic wikitext when offline."""
    used = []
    try:
        import datasets
    except ImportError:
        class Dataset:
            def __init__(self, records):
                self._records = records

            @classmethod
            def from_dict(cls, columns):
                return cls([dict(zip(columns, vals)) for vals in zip(*columns.values())])

            def filter(self, fn):
                return Dataset([r for r in self._records if fn(r)])

            def map(self, fn):
                return Dataset([{**r, **fn(r)} for r in self._records])

            def __len__(self):
                return len(self._records)

            def __getitem__(self, i):
                return self._records[i]

        datasets = _module("datasets", Dataset=Dataset, load_dataset=None)
        used.append("datasets (minimal Dataset)")
    real = datasets.load_dataset

    def load_dataset(path, *args, **kwargs):
        if real is not None:
            try:
                return real(path, *args, **kwargs)
            except Exception:
                if path != "wikitext":
                    raise
        print(f"{TAG} load_dataset({path!r}): offline stand-in, 2000 synthetic lines",
              flush=True)
        return datasets.Dataset.from_dict({"text": _wikitext_lines()})

    datasets.load_dataset = load_dataset
    return ", ".join(used + ["datasets.load_dataset (real first, synthetic wikitext offline)"])


def _standin_tokenizer() -> str:
    """`AutoTokenizer.from_pretrained`: the real one first, a word-level one offline."""
    import transformers
    real = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(name, *args, **kwargs):
        try:
            return real(name, *args, **kwargs)
        except OSError:
            pass
        from tokenizers import Tokenizer, models, pre_tokenizers
        print(f"{TAG} AutoTokenizer.from_pretrained({name!r}): offline word-level stand-in",
              flush=True)
        vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", *WORDS, "<mask>"])}
        backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return transformers.PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
            unk_token="<unk>", mask_token="<mask>")

    transformers.AutoTokenizer.from_pretrained = staticmethod(from_pretrained)
    return "AutoTokenizer.from_pretrained (real first, word-level offline)"


def _standin_fire() -> str:
    def parse(text):
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text

    def Fire(component):
        argv, kwargs, i = sys.argv[1:], {}, 0
        while i < len(argv):
            if not argv[i].startswith("--"):
                raise SystemExit(f"fire stand-in takes --name value flags only, got {argv[i]!r}")
            key, value = argv[i][2:], "True"
            if "=" in key:
                key, value = key.split("=", 1)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            kwargs[key.replace("-", "_")] = parse(value)
            i += 1
        return component(**kwargs)

    _module("fire", Fire=Fire)
    return "fire"


def _standin_loguru() -> str:
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(levelname)s | %(message)s")
    _module("loguru", logger=logging.getLogger("loguru-standin"))
    return "loguru"


def _standin_tensorboard() -> str:
    class SummaryWriter:
        def __init__(self, *args, **kwargs):
            pass

        def __getattr__(self, name):  # add_scalar, flush, close, ...: no-ops
            return lambda *args, **kwargs: None

    _module("torch.utils.tensorboard", SummaryWriter=SummaryWriter)
    return "torch.utils.tensorboard (no-op SummaryWriter)"


def _standin_sh() -> str:

    class ErrorReturnCode(Exception):
        pass

    class ErrorReturnCode_128(ErrorReturnCode):
        pass

    class ErrorReturnCode_129(ErrorReturnCode):
        pass

    def log(*args, **kwargs):
        raise ErrorReturnCode_128("git log: not run by the offline stand-in")

    def diff(*args, **kwargs):
        raise ErrorReturnCode_129("git diff: not run by the offline stand-in")

    _module("sh", ErrorReturnCode=ErrorReturnCode, ErrorReturnCode_128=ErrorReturnCode_128,
            ErrorReturnCode_129=ErrorReturnCode_129,
            git=types.SimpleNamespace(log=log, diff=diff))
    return "sh (git log/diff -> ErrorReturnCode_128/_129)"


def _launch_time() -> float:
    """Start time of the parent process (torchrun's agent, shared by the ranks)."""
    try:
        with open(f"/proc/{os.getppid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _standin_pytz() -> str:
    import datetime as dt

    class LaunchClock(dt.tzinfo):
        def __init__(self, name):
            self.name = name

        def utcoffset(self, d):
            return dt.timedelta(0)

        def dst(self, d):
            return dt.timedelta(0)

        def tzname(self, d):
            return self.name

        def fromutc(self, d):  # datetime.now(tz): the launch time, equal on every rank
            return dt.datetime.fromtimestamp(int(_launch_time()), dt.timezone.utc) \
                .replace(tzinfo=self)

    _module("pytz", timezone=LaunchClock)
    return "pytz (launch-time clock)"


def _imports(source: str) -> set[str]:
    """Top-level names of the modules a script imports (anywhere in the file)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def install_standins(script: Path) -> list[str]:
    mods = _imports(script.read_text())
    tops = {m.split(".")[0] for m in mods}
    used = []
    if "torchvision" in tops and not (_importable("torchvision")
                                      and Path("data/cifar-10-batches-py").is_dir()):
        used.append(_standin_torchvision())
    if "datasets" in tops:
        used.append(_standin_datasets())
    if "transformers" in tops:
        used.append(_standin_tokenizer())
    if "torch.utils.tensorboard" in mods and not _importable("tensorboard"):
        used.append(_standin_tensorboard())
    for name, make in (("fire", _standin_fire), ("loguru", _standin_loguru),
                       ("sh", _standin_sh), ("pytz", _standin_pytz)):
        if name in tops and not _importable(name):
            used.append(make())
    return used
