"""What the checkpoint formats share: refusals that name the config field, validation into the format's
own typed model, and the stored tensors grouped by layer."""
from __future__ import annotations

import re
from collections import defaultdict

from pydantic import BaseModel, ValidationError

from polychip.errors import ModelLoadError


def refuse(source: str, where: str, why: str):
    """A refused checkpoint: one error naming the format, the config field and the reason."""
    raise ModelLoadError(f"{source} checkpoint: {where}: {why}")


def validated(model_cls: type[BaseModel], data, source: str, root: str = "quantization_config"):
    """``data`` validated into ``model_cls``; each problem named by its field path."""
    if not isinstance(data, dict):
        refuse(source, root, f"expected a mapping, got {type(data).__name__}")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            # a union's branches show in the path as type names ("list[str]", "function-after[...]"):
            # keep the field names, and drop the branch that only says "not a list"
            if str(err["loc"][-1]).startswith("list[") and len(e.errors()) > 1:
                continue
            where = ".".join(str(p) for p in (root, *err["loc"]) if not re.search(r"[\[(]", str(p)))
            problems.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
        raise ModelLoadError(f"{source} checkpoint: " + "; ".join(problems[:4])) from None
    except (ValueError, TypeError) as e:       # a library validator that raises outside pydantic
        raise ModelLoadError(f"{source} checkpoint: {root}: {e}") from None


def group_tensors(stored) -> dict[str, set[str]]:
    """{layer path: {local tensor names}} from state-dict keys ("layers.0.mlp.up_proj.qweight")."""
    out: dict[str, set[str]] = defaultdict(set)
    for key in stored:
        path, _, local = key.rpartition(".")
        out[path].add(local)
    return dict(out)
