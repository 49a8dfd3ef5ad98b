"""Where batch objects persist: one JSON file per batch under ``<files-dir>/batches/``, replaced
atomically. The small interface (load_all, save) is what the router's state store takes over."""
from __future__ import annotations

import json
import os


class BatchStore:
    def __init__(self, root: str):
        self.root = os.path.join(root, "batches")
        os.makedirs(self.root, exist_ok=True)

    def save(self, batch: dict) -> None:
        path = os.path.join(self.root, batch["id"] + ".json")
        with open(path + ".tmp", "w") as f:
            json.dump(batch, f)
        os.replace(path + ".tmp", path)

    def load_all(self) -> list[dict]:
        out = []
        for name in sorted(os.listdir(self.root)):
            if name.endswith(".json"):
                with open(os.path.join(self.root, name)) as f:
                    out.append(json.load(f))
        return out
