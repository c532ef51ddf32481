"""The in-image ``ca-keeper`` script loaded as a module (its framing and output log under test).

Compiled from source into a fresh module, so no bytecode lands next to the image's helpers
(the helpers directory is an image input).
"""

from __future__ import annotations

import types
from functools import cache

from tests.support.keeper_local import KEEPER


@cache
def keeper_script() -> types.ModuleType:
    mod = types.ModuleType("ca_keeper")
    mod.__file__ = str(KEEPER)
    exec(compile(KEEPER.read_text(), str(KEEPER), "exec"), mod.__dict__)  # noqa: S102 - our own helper
    mod.load_keeper_modules()
    return mod
