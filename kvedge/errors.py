"""The one error family of kvedge.

Every message says what was wrong, where (file, tensor, argument) and what would be right.
The CLI prints the message without a traceback (unless --debug) and exits non-zero.
"""


class KvedgeError(Exception):
    """Base of every error kvedge raises on purpose."""


class ConfigError(KvedgeError):
    """A model config (config.json or a sidecar) is missing, malformed or unsupported."""


class CheckpointError(KvedgeError):
    """A checkpoint's weights are missing, extra, of the wrong shape or dtype, or in a refused format."""


class MissingDependencyError(KvedgeError):
    """An optional package that a feature needs is not installed."""


def require(module: str, extra: str, feature: str):
    """Import an optional dependency, or raise a one-line error naming the package and what installs it
    (`extra` is a kvedge extra, or the package itself when it is a core dependency)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:  # pragma: no cover - exercised where the package is absent
        raise MissingDependencyError(
            f"{feature} needs the '{module.split('.')[0]}' package: pip install "
            + (f"'kvedge[{extra}]'" if extra != module.split(".")[0] else extra) + f" ({e})"
        ) from None
