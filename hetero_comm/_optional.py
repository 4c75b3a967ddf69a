"""Imports of the packages that only some features need, each named by its pip extra."""

import importlib
from types import ModuleType


def import_optional(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module``, or raise ``ImportError`` saying that ``feature`` needs it and which
    extra of hetero_comm installs it (``pip install "hetero_comm[<extra>]"``)."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.split(".")[0]
        raise ImportError(f"{feature} needs {package}, which is not installed: "
                          f'pip install "hetero_comm[{extra}]" (or pip install {package})') from error
