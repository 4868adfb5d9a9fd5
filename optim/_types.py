"""Named type aliases of the public signatures, as Optax names its own.

Each is a `typing_extensions.TypeAliasType`, so ``help()``, ``inspect.signature``
and IDEs show the alias's name (``learning_rate: ScalarOrSchedule``) instead of
the union it stands for, while ``typing.get_type_hints`` still resolves it.
"""

from collections.abc import Callable
from typing import Any

import jax
import optax
from typing_extensions import TypeAliasType

__all__ = ["ScalarOrSchedule", "Numeric", "MaskOrFn"]

# A number, a scalar array, or an Optax schedule of the step count.
ScalarOrSchedule = TypeAliasType("ScalarOrSchedule", optax.ScalarOrSchedule)

# A number or a scalar array: a hyperparameter, possibly traced.
Numeric = TypeAliasType("Numeric", jax.typing.ArrayLike)

# A tree of bools with the params' structure (or a prefix of it), a callable
# returning one from the params, or None (every leaf).
MaskOrFn = TypeAliasType("MaskOrFn", Any | Callable[[optax.Params], Any] | None)
