"""Model registry: a zoo name or a user factory ``package.module:function`` -> ``nn.Module``.

Also the one place that knows a model's pipeline blocks: the ordered modules that, applied
one after the other, compute the model, and between which a pipeline may cut stages.
"""

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch.nn as nn

from partrain.errors import PartrainError, causes
from partrain.models.cnn import cnn
from partrain.models.gpt import gpt
from partrain.models.mlp import mlp
from partrain.models.mobilenet import mobilenetv2
from partrain.models.resnet import resnet18, resnet50, resnet152
from partrain.models.vgg import vgg11, vgg16

_ZOO: dict[str, Callable[..., nn.Module]] = {
    "mlp": mlp,
    "cnn": cnn,
    "resnet18": resnet18,
    "resnet50": resnet50,
    "resnet152": resnet152,
    "vgg11": vgg11,
    "vgg16": vgg16,
    "mobilenetv2": mobilenetv2,
    "gpt": gpt,
}

# A user factory's explicit blocks live here, as a plain list so nn.Module does not register
# the submodules a second time.
_BLOCKS_ATTR = "_partrain_blocks"


def list_models() -> list[str]:
    """The zoo's model names."""
    return list(_ZOO)


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (shared ones counted once), trainable or not."""
    return sum(p.numel() for p in model.parameters())


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The ordered blocks of ``model``: applied in order to an input, they compute ``model(input)``.

    The blocks a user factory returned; else the children of an ``nn.Sequential`` (every zoo
    model is one); else ``[model]``, a single block, which pipelines split into blocks with
    ``torch.distributed.pipelining``'s tracer (``strategies/traced.py``).
    """
    blocks = getattr(model, _BLOCKS_ATTR, None)
    if blocks is not None:
        return list(blocks)
    if isinstance(model, nn.Sequential):
        return list(model.children())
    return [model]


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, **options) -> nn.Module:
    """Build a zoo model, or call the user factory ``package.module:function``.

    ``input_shape`` is one sample's shape, ``(C, H, W)`` for images. ``options`` go to the
    builder (for ``mlp``: ``activation``, ``hidden``). A factory is called with those of
    ``input_shape``, ``num_classes`` and ``options`` it accepts by name; it returns an
    ``nn.Module`` or a tuple ``(module, blocks)`` with the module's pipeline blocks.
    """
    input_shape = tuple(input_shape)
    if not input_shape or not all(isinstance(d, int) and d > 0 for d in input_shape):
        raise PartrainError(
            f"input_shape must be positive sizes such as (3, 32, 32), got {input_shape}"
        )
    if not isinstance(num_classes, int) or num_classes < 1:
        raise PartrainError(f"num_classes must be a positive integer, got {num_classes!r}")
    if name in _ZOO:
        return _call(name, _ZOO[name], input_shape, num_classes, options)
    return _build_user_model(name, input_shape, num_classes, options)


def _call(
    name: str, factory: Callable, input_shape: tuple[int, ...], num_classes: int, options: dict
):
    """Call ``factory`` with what it accepts of ``input_shape``, ``num_classes`` and the options,
    positional-only parameters by position, the rest by name; an option it does not accept, or
    a parameter it needs that partrain does not pass, is one line."""
    Kind = inspect.Parameter
    params = inspect.signature(factory).parameters
    open_ended = any(p.kind is Kind.VAR_KEYWORD for p in params.values())  # **kwargs takes any option
    given = {"input_shape": input_shape, "num_classes": num_classes, **options}
    unknown = [key for key in options if not open_ended and key not in params]
    if unknown:
        accepted = [key for key in params if key not in ("input_shape", "num_classes")]
        raise PartrainError(
            f"model {name!r} has no option {unknown[0]!r}; "
            f"its options are: {', '.join(accepted) or 'none'}"
        )
    missing = [p.name for p in params.values() if p.default is Kind.empty and p.name not in given
               and p.kind not in (Kind.VAR_POSITIONAL, Kind.VAR_KEYWORD)]
    if missing:
        raise PartrainError(f"model {name!r}: its factory needs {missing[0]!r}, which partrain does not pass: it passes "
                            "input_shape and num_classes by those names, and --model-option KEY=VALUE for the rest")
    positional = [p.name for p in params.values() if p.kind is Kind.POSITIONAL_ONLY]
    last = max((i for i, key in enumerate(positional) if key in given), default=-1)  # those after it keep defaults
    if skipped := [key for key in positional[:last] if key not in given]:
        raise PartrainError(f"model {name!r}: its factory takes {skipped[0]!r} by position only, before "
                            f"{positional[last]!r}: give --model-option {skipped[0]}=VALUE too")
    named = {key: value for key, value in given.items() if key not in positional and (open_ended or key in params)}
    return _guarded(name, factory, *(given[key] for key in positional[:last + 1]), **named)


def _guarded(name: str, factory: Callable, *args, **kwargs):
    """Call a factory; what goes wrong inside the user's code is one line naming the factory
    (its traceback with ``--debug``), not a traceback from deep inside partrain."""
    if name in _ZOO:  # each zoo model checks its own options (gpt, mlp): one line each
        return factory(*args, **kwargs)
    try:
        return factory(*args, **kwargs)
    except SystemExit as err:
        raise PartrainError(f"model {name!r}: the factory called sys.exit({err.code!r}); "
                            "return the model instead of exiting") from err
    except Exception as err:  # noqa: BLE001 - anything the user's code raises
        raise PartrainError(f"model {name!r}: the factory raised {type(err).__name__}: {err} "
                            "(--debug shows its traceback)") from err


# modules partrain calls that are not the user's layers: the loss, and the wrappers strategies add
_NOT_THE_MODEL = (nn.modules.loss._Loss, nn.parallel.DistributedDataParallel)


def _users_package(spec: str) -> tuple[str, ...]:
    """Where the code of a user factory ``package.module:function`` lives: its top-level
    package's folders, or the module's own file (a module outside any package)."""
    top = sys.modules.get(spec.partition(":")[0].split(".")[0])
    if top is None:
        return ()
    places = list(getattr(top, "__path__", [])) or [getattr(top, "__file__", None) or ""]
    return tuple(str(Path(p).resolve()) + (os.sep if Path(p).is_dir() else "") for p in places if p)


def raised_by_model(err: BaseException, spec: str, doing: str) -> PartrainError | None:
    """The one line for an exception raised inside the user's model ``spec`` as it was ``doing``
    (training, being profiled): BatchNorm on a batch of one, an assertion in its forward. It
    names the model and where: the deepest of its layers, or of its package's lines, that the
    error passed through. An error that a runtime wrapped (the pipelining stage's "failed to
    run forward") is told by its cause. None for the zoo's models and for errors that never
    entered the user's model, which keep their traceback (partrain's bugs among them)."""
    if spec in _ZOO:
        return None
    places, found = _users_package(spec), None
    for e in causes(err):
        if (where := _where_in_model(e, places)) is not None:
            found = (e, where)  # the innermost one that passed through the model wins
    if found is None:
        return None
    err, where = found
    reason = next((line for line in str(err).splitlines() if line.strip()), "")
    return PartrainError(f"model {spec!r} raised {type(err).__name__} while {doing} ({where})"
                         f"{': ' + reason.strip() if reason else ''} (--debug shows the traceback)")


def _where_in_model(err: BaseException, places: tuple[str, ...]) -> str | None:
    """The deepest frame of ``err``'s traceback in the user's package (file, line), or else in a
    layer's forward (its class); None when it passed through neither."""
    where, tb = None, err.__traceback__
    while tb is not None:  # outermost frame first; the last match is nearest the error
        code = tb.tb_frame.f_code
        if places and code.co_filename[:1] != "<" and str(Path(code.co_filename).resolve()).startswith(places):
            where = f"{Path(code.co_filename).name}:{tb.tb_lineno}, in {code.co_name}"
        elif code.co_name == "_call_impl" and isinstance(layer := tb.tb_frame.f_locals.get("self"), nn.Module) \
                and not isinstance(layer, _NOT_THE_MODEL):
            where = f"in its {type(layer).__name__}"
        tb = tb.tb_next
    return where


def load_factory(spec: str) -> Callable:
    """The zoo's builder of ``spec``, or the user factory ``package.module:function`` with its
    module imported (once per process).

    The training loop calls this before it seeds torch's generator, so that random numbers a
    module draws as it is imported (a constant projection, a test tensor) come before the seed
    in every process alike and never shift the initial weights (issue 17's audit: serial, whose
    launcher had imported the module to check it, and ddp started from different weights)."""
    if spec in _ZOO:
        return _ZOO[spec]
    if ":" not in spec:
        raise PartrainError(
            f"unknown model {spec!r}: choose one of {', '.join(_ZOO)}, "
            "or give your own factory as 'package.module:function'"
        )
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise PartrainError(f"model {spec!r}: write a user factory as 'package.module:function'")
    factory = _import(spec, module_name)
    try:
        for part in attr.split("."):
            factory = getattr(factory, part)
    except AttributeError as err:
        raise PartrainError(
            f"model {spec!r}: module {module_name!r} has no attribute {attr!r}; "
            "check the name after the colon"
        ) from err
    if not callable(factory):
        raise PartrainError(
            f"model {spec!r}: {attr!r} is not callable; point at a function that builds the model"
        )
    return factory


def source_digest(spec: str) -> str | None:
    """A short hash of the source user factory ``spec`` is built from (None for the zoo, or a
    module not found as a file): a profile cached for a model the user has since edited is not
    the profile of the model that will train. The source is every ``.py`` file of the
    factory's top-level package, or, for a module outside any package, the ``.py`` files
    beside it and in the packages beside it (its own file alone where it is installed among
    other distributions, or beside more than ``MAX_SOURCE_FILES``): a model class or a layer
    kept in a module the factory imports is part of the model too."""
    if spec in _ZOO or ":" not in spec:
        return None
    import hashlib
    import importlib.util

    try:
        module = spec.partition(":")[0]
        found = importlib.util.find_spec(module)
        origin = Path(found.origin) if found and found.origin else None
        if origin is None or not origin.is_file():
            return None
        digest = hashlib.sha256()
        for name, path in _source_files(module, origin):  # the names too: a file renamed or moved is another model
            digest.update(f"{name}\0".encode())
            digest.update(path.read_bytes())
        return digest.hexdigest()[:10]
    except (ImportError, ValueError, OSError):  # not importable: building the model says why, in one line
        return None


MAX_SOURCE_FILES = 500


def _source_files(module: str, origin: Path) -> list[tuple[Path, Path]]:
    """(name, path) of the ``.py`` files ``source_digest`` hashes, sorted (see there)."""
    import importlib.util
    import site
    import sysconfig

    top = importlib.util.find_spec(module.partition(".")[0])
    alone = [(Path(origin.name), origin)]
    if top is not None and top.submodule_search_locations:  # a package (a namespace one may have several roots): all of it
        roots = [Path(root) for root in top.submodule_search_locations]
        files = sorted((f.relative_to(root.parent), f) for root in roots for f in root.rglob("*.py"))
        return files if len(files) <= MAX_SOURCE_FILES else alone
    here = origin.parent
    shared = {Path(p).resolve() for p in (*site.getsitepackages(), site.getusersitepackages(),
                                           *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")))}
    if here.resolve() in shared:  # a module installed among other distributions: its neighbours are not its source
        return alone
    packages = [d for d in here.iterdir() if (d / "__init__.py").is_file()]
    files = sorted((f.relative_to(here), f) for f in [*here.glob("*.py"), *(f for d in packages for f in d.rglob("*.py"))])
    return files if len(files) <= MAX_SOURCE_FILES else alone


def _import(spec: str, module_name: str):
    """The user's module, imported; what goes wrong is one line that says whose fault it is:
    a module not found (spelling, PYTHONPATH), or the module's own code (a syntax error, an
    import of its own that is missing, an exception or ``sys.exit`` as it runs)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(f"{err.name}.")):
            raise PartrainError(f"model {spec!r}: cannot import module {module_name!r} ({err}); "
                                "check the spelling and that its directory is on PYTHONPATH") from err
        raise PartrainError(f"model {spec!r}: module {module_name!r} was found, but its own import of {err.name!r} "
                            f"failed ({err}); install what it needs") from err
    except SyntaxError as err:
        raise PartrainError(f"model {spec!r}: module {module_name!r} has a syntax error "
                            f"({Path(err.filename or '?').name}:{err.lineno}: {err.msg})") from err
    except SystemExit as err:
        raise PartrainError(f"model {spec!r}: importing module {module_name!r} called sys.exit({err.code!r}); "
                            "a module that builds a model should not exit as it is imported") from err
    except Exception as err:  # noqa: BLE001 - anything the user's module raises as it runs
        raise PartrainError(f"model {spec!r}: importing module {module_name!r} raised {type(err).__name__}: {err} "
                            "(--debug shows its traceback)") from err


def _build_user_model(
    spec: str, input_shape: tuple[int, ...], num_classes: int, options: dict
) -> nn.Module:
    factory = load_factory(spec)
    result = _call(spec, factory, input_shape, num_classes, options)
    model, blocks = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
    if not isinstance(model, nn.Module):
        raise PartrainError(
            f"model {spec!r}: the factory returned a {type(result).__name__}, not an nn.Module "
            "or a tuple (nn.Module, list of blocks); return the model"
        )
    if blocks is not None:
        owned = {id(m) for m in model.modules()}
        blocks = list(blocks) if isinstance(blocks, Iterable) else []
        if not blocks or not all(isinstance(b, nn.Module) and id(b) in owned for b in blocks):
            raise PartrainError(
                f"model {spec!r}: the factory's blocks must be a non-empty list of submodules "
                "of the model it returned"
            )
        setattr(model, _BLOCKS_ATTR, blocks)
    return model
