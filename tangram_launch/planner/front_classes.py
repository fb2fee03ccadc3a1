"""Front classes: islands whose links from every other island are the same, so that the composer's exact search
(compose.py, ``merge_fronts``) keys sequences of one island set by their front island's class, not the island."""
from __future__ import annotations

from typing import Sequence


def merged_states(link_s: Sequence[Sequence[float]], present: Sequence[int]) -> int:
    """DP keys per layer of the exact search with ``merge_fronts`` over the islands ``present``: the island sets
    times the front classes each meets."""
    cls = front_classes(link_s, sum(1 << k for k in present))
    sizes: dict[int, int] = {}
    for k in present:
        sizes[cls[k]] = sizes.get(cls[k], 0) + 1
    n = len(present)
    return sum((1 << n) - (1 << (n - c)) for c in sizes.values())  # a class of c islands misses 2^(n - c) sets


def front_classes(link_s: Sequence[Sequence[float]], islands: int) -> list[int]:
    """cls[k]: the island standing for k's class among the islands in the mask ``islands``: islands whose links
    from every other island are the same.

    The exact DP keys a sequence by the set of islands it uses and its front island; the front matters only
    through the link from the island added in front of it, which is never in the set. Fronts f and g of one set
    are interchangeable when link[x][f] == link[x][g] for every island x other than f and g, so with
    ``merge_fronts`` the DP keys by class and reads the link through an entry's actual front. Classes are cliques
    of that relation, built greedily in index order (it is not transitive: link[g][f] and link[g][h] may differ).
    Islands that all talk over one spine form one class: about 2^K keys per layer instead of K x 2^(K-1)."""
    members = [k for k in range(len(link_s)) if islands >> k & 1]
    cls = list(range(len(link_s)))
    groups: list[list[int]] = []

    def alike(f: int, g: int) -> bool:
        return all(link_s[x][f] == link_s[x][g] for x in members if x != f and x != g)

    for k in members:
        for group in groups:
            if all(alike(k, g) for g in group):
                group.append(k)
                cls[k] = group[0]
                break
        else:
            groups.append([k])
    return cls
