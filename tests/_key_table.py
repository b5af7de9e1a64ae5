"""A fake key source for index tests: what the store's vector table offers an index (sorted ids, raw keys, rows by
id, a version bumped by each write), without a store. Shared by tests/test_graph_file.py and
tests/test_index_storage.py."""

from __future__ import annotations

import torch


class KeyTable:
    """A key source as the store offers it: sorted ids, raw keys, rows by id, a version bumped by each write."""

    def __init__(self, ids: torch.Tensor, keys: torch.Tensor) -> None:
        order = torch.argsort(ids)
        self.ids, self.keys, self.version = ids[order], keys[order].contiguous(), 1

    def rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu()  # (m,)
        if len(self.ids) == 0:
            return torch.full_like(ids.cpu(), -1)
        pos = torch.searchsorted(self.ids, flat).clamp(max=len(self.ids) - 1)  # (m,)
        return torch.where(self.ids[pos] == flat, pos, -1).reshape(ids.shape)

    def append(self, ids: torch.Tensor, keys: torch.Tensor) -> None:
        ids, keys = torch.cat([self.ids, ids]), torch.cat([self.keys, keys])
        order = torch.argsort(ids)  # re-added ids take their place: the ids stay sorted
        self.ids, self.keys, self.version = ids[order], keys[order].contiguous(), self.version + 1

    def drop(self, ids: torch.Tensor) -> None:
        keep = ~torch.isin(self.ids, ids)  # (n,)
        self.ids, self.keys, self.version = self.ids[keep], self.keys[keep].contiguous(), self.version + 1
