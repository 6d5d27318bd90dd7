"""How the template writes files that people and other programs read: JSON that every JSON
reader takes. A leaf: imports nothing from the project."""

from __future__ import annotations

import json
import math
from typing import Any


def json_text(value: Any, indent: int | None = None) -> str:
    """`value` as JSON, each NaN or infinity as null: Python writes them as `NaN` and `Infinity`,
    which are not JSON, and `jq`, JavaScript's `JSON.parse` and many dashboards reject the file."""
    return json.dumps(finite_or_null(value), indent=indent, allow_nan=False)


def finite_or_null(value: Any) -> Any:
    """`value` with every non-finite float in it (in lists and dicts too) as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value
