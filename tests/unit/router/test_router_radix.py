"""The router's approximate radix tree: matching, sizes, LRU eviction, tenant removal."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from router.radix import RadixTree, _common_prefix


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def _check_invariants(tree: RadixTree) -> None:
    sizes: dict[str, int] = {}
    stack = [tree.root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            assert child.parent is node and child.text and node.children[child.text[0]] is child
            assert set(child.tenants) <= set(node.tenants) or node is tree.root  # tenant => on every ancestor
            assert child.tenants, "a node with no tenant must be pruned"
            for t in child.tenants:
                sizes[t] = sizes.get(t, 0) + len(child.text)
            stack.append(child)
    for t in tree.tenants():
        assert tree.size(t) == sizes.get(t, 0), t


def test_common_prefix():
    assert _common_prefix("abcdef", "xxabcxyz", 2) == 3
    assert _common_prefix("abc", "abc", 0) == 3
    assert _common_prefix("abc", "ab", 0) == 2
    assert _common_prefix("abc", "zzz", 0) == 0


def test_match_reports_each_tenants_longest_prefix():
    tree = RadixTree(Clock())
    tree.insert("hello world", "a")
    tree.insert("hello there", "b")
    tree.insert("help", "a")
    assert tree.match("hello world!") == {"a": 11, "b": 6}
    assert tree.match("hello thermos") == {"a": 6, "b": 10}
    assert tree.match("helping") == {"a": 4, "b": 3}
    assert tree.match("zebra") == {}
    assert tree.match("") == {}
    assert tree.size("a") == len("hello world") + 1  # "help" shares "hel", adds "p"
    assert tree.size("b") == len("hello there")
    _check_invariants(tree)


def test_insert_same_text_twice_does_not_grow():
    tree = RadixTree(Clock())
    tree.insert("abcdef", "a")
    tree.insert("abcdef", "a")
    tree.insert("abc", "a")
    assert tree.size("a") == 6
    _check_invariants(tree)


def test_eviction_drops_least_recently_used_leaves_first():
    tree = RadixTree(Clock())
    tree.insert("system-A question 1", "w")
    tree.insert("system-B question 1", "w")
    tree.insert("system-A question 2", "w")  # A is newer than B now
    tree.insert("system-A question 1", "w")
    before = tree.size("w")
    tree.evict(before - 1)
    assert tree.size("w") <= before - 1
    # B's branch went first: A still matches fully.
    assert tree.match("system-A question 1")["w"] == len("system-A question 1")
    assert tree.match("system-B question 1")["w"] < len("system-B question 1")
    tree.evict(0)
    assert tree.size("w") == 0 and tree.match("system-A") == {}
    _check_invariants(tree)


def test_eviction_keeps_other_tenants_nodes():
    tree = RadixTree(Clock())
    tree.insert("shared prefix one", "a")
    tree.insert("shared prefix one", "b")
    tree._evict_tenant("a", 0)
    assert tree.size("a") == 0 and tree.match("shared prefix one") == {"b": len("shared prefix one")}
    _check_invariants(tree)


def test_remove_tenant():
    tree = RadixTree(Clock())
    tree.insert("abc def", "a")
    tree.insert("abc xyz", "b")
    tree.remove_tenant("a")
    assert "a" not in tree.tenants() and tree.match("abc def") == {"b": 4}
    _check_invariants(tree)
    tree.remove_tenant("b")
    assert tree.node_count() == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text(alphabet="abc", max_size=12), st.sampled_from("xyz")), max_size=30),
       st.integers(min_value=0, max_value=20))
def test_random_inserts_keep_invariants_and_match_is_exact(ops, cap):
    tree = RadixTree(Clock())
    routed: dict[str, list[str]] = {}
    for text, tenant in ops:
        tree.insert(text, tenant)
        routed.setdefault(tenant, []).append(text)
    _check_invariants(tree)
    probe = "".join(random.Random(len(ops)).choice("abc") for _ in range(10))
    got = tree.match(probe)
    for tenant, texts in routed.items():
        want = max(len(_lcp(probe, t)) for t in texts)
        assert got.get(tenant, 0) == want
    tree.evict(cap)
    _check_invariants(tree)
    assert all(tree.size(t) <= cap for t in tree.tenants())


def _lcp(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]
