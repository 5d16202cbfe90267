"""An approximate, multi-tenant character radix tree (SGLang's cache_aware tree, in Python).

One tree holds the routed text of every worker ("tenant"); each node records which tenants
passed through it and when. It is *approximate*: it is the router's guess of what each
engine's prefix cache holds, built from the text it routed there, never from the engine.

Invariants:
- a tenant present on a node is present on every ancestor of that node, and the tenant's
  inserted text covers the node's whole edge (inserts split edges at their end);
- ``size(t)`` is the number of characters on the nodes that hold tenant ``t``;
- a node with no tenants has no children (eviction removes leaves first, then prunes).
Cost: match and insert walk at most ``len(text)`` characters with C-speed slice compares;
callers cut text to a bounded prefix, so the cost per request is flat.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable


class _Node:
    __slots__ = ("text", "parent", "children", "tenants")

    def __init__(self, text: str, parent: "_Node | None"):
        self.text = text
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tenants: dict[str, float] = {}  # tenant -> last access (monotonic seconds)


def _common_prefix(edge: str, text: str, start: int) -> int:
    """Length of the common prefix of ``edge`` and ``text[start:]`` (binary search on slices)."""
    hi = min(len(edge), len(text) - start)
    if text.startswith(edge[:hi], start):
        return hi
    lo = 0  # invariant: edge[:lo] matches, edge[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if text.startswith(edge[:mid], start):
            lo = mid
        else:
            hi = mid
    return lo


class RadixTree:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.root = _Node("", None)
        self._sizes: dict[str, int] = {}
        self._clock = clock

    # ------------------------------------------------------------------ queries
    def size(self, tenant: str) -> int:
        return self._sizes.get(tenant, 0)

    def tenants(self) -> list[str]:
        return list(self._sizes)

    def match(self, text: str) -> dict[str, int]:
        """For each tenant, how many leading characters of ``text`` it has routed before."""
        matched: dict[str, int] = {}
        node, i, n = self.root, 0, len(text)
        while i < n:
            child = node.children.get(text[i])
            if child is None:
                break
            edge = child.text
            k = len(edge) if text.startswith(edge, i) else _common_prefix(edge, text, i)
            i += k
            for tenant in child.tenants:
                matched[tenant] = i
            if k < len(edge):
                break
            node = child
        return matched

    # ------------------------------------------------------------------ updates
    def insert(self, text: str, tenant: str) -> None:
        now = self._clock()
        node, i, n = self.root, 0, len(text)
        node.tenants[tenant] = now
        self._sizes.setdefault(tenant, 0)
        while i < n:
            first = text[i]
            child = node.children.get(first)
            if child is None:
                leaf = _Node(text[i:], node)
                leaf.tenants[tenant] = now
                node.children[first] = leaf
                self._sizes[tenant] += n - i
                return
            edge = child.text
            k = len(edge) if text.startswith(edge, i) else _common_prefix(edge, text, i)
            if k < len(edge):
                child = self._split(node, child, k)
            if tenant not in child.tenants:
                self._sizes[tenant] += len(child.text)
            child.tenants[tenant] = now
            i += k
            node = child

    @staticmethod
    def _split(parent: _Node, child: _Node, k: int) -> _Node:
        """Cut ``child``'s edge after k characters; the new middle node keeps its tenants."""
        mid = _Node(child.text[:k], parent)
        mid.tenants = dict(child.tenants)
        child.text = child.text[k:]
        child.parent = mid
        mid.children[child.text[0]] = child
        parent.children[mid.text[0]] = mid
        return mid

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything routed to ``tenant`` (its worker was removed)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.tenants.pop(tenant, None) is None:
                continue  # by the invariant, no descendant holds it either
            stack.extend(node.children.values())
            if not node.tenants and node is not self.root:
                self._unlink(node)
        self._sizes.pop(tenant, None)

    def evict(self, max_size: int) -> int:
        """Drop each tenant's least recently used leaves until its size is <= max_size."""
        removed = 0
        for tenant, size in list(self._sizes.items()):
            if size > max_size:
                removed += self._evict_tenant(tenant, max_size)
        return removed

    def _evict_tenant(self, tenant: str, max_size: int) -> int:
        order = itertools.count()  # tie-breaker: nodes are not comparable
        heap = [(t, next(order), node) for node, t in self._leaves(tenant)]
        heapq.heapify(heap)
        removed = 0
        while heap and self._sizes[tenant] > max_size:
            _, _, node = heapq.heappop(heap)
            del node.tenants[tenant]
            self._sizes[tenant] -= len(node.text)
            removed += len(node.text)
            parent = node.parent
            if not node.tenants:
                self._unlink(node)
            if parent is not None and parent is not self.root and self._is_leaf_of(parent, tenant):
                heapq.heappush(heap, (parent.tenants[tenant], next(order), parent))
        return removed

    def _leaves(self, tenant: str):
        stack = [self.root]
        while stack:
            node = stack.pop()
            kids = [c for c in node.children.values() if tenant in c.tenants]
            if not kids and node is not self.root:
                yield node, node.tenants[tenant]
            stack.extend(kids)

    @staticmethod
    def _is_leaf_of(node: _Node, tenant: str) -> bool:
        return tenant in node.tenants and not any(tenant in c.tenants for c in node.children.values())

    @staticmethod
    def _unlink(node: _Node) -> None:
        parent = node.parent
        if parent is not None and parent.children.get(node.text[0]) is node:
            del parent.children[node.text[0]]
            node.parent = None

    def node_count(self) -> int:
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count
