"""Speculative decoding along a DDTree tree (`speculate --tree BUDGET`), greedy.

A round drafts the block as usual, then grows DDTree's best-first tree from the
drafted slots' log-probabilities (`train.measures.best_first_tree`, the rule
`eval`'s `ddtree` figure reads, over the same per-slot lists: log_softmax of the
drafter's logits through the target's head; for DFlash 2 its unary lists, not the
selector's walk). The target's greedy output is then followed down the tree from the
anchor: a node is accepted when its token is the target's argmax after its parent's
path; the target's token after the last accepted node is the bonus. Every committed
token is the target's greedy choice, so the output equals greedy decoding.

Verification, exact either way (the JSON names which ran, `verify`):

- `tree_attention` (a target whose every layer is a plain attention cache): one forward
  over the anchor and every node, each attending to the verified prefix and to its own
  ancestors, at position start + depth; the cache then keeps the anchor and the
  accepted path's keys and values (`TargetSession.keep_nodes`).
- `chains` (layers with a recurrent state, Qwen3.5's Gated DeltaNet, which no tree mask
  can cover; or a sliding-window cache): the path from the anchor down the most likely
  children is verified as a chain in one forward; where the target's token is another
  child of the node reached, the chain from that child is verified next, from the state
  after the accepted tokens. A round costs one forward per branch it takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice

import torch

from train.decoding.target_decode import tree_maskable
from train.measures import best_first_tree


@dataclass
class DraftTree:
    """Node 0 is the anchor; node i > 0 holds `tokens[i]` below `parents[i]` at `depths[i]`."""

    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    children: dict[int, dict[int, int]] = field(default_factory=dict)  # node -> {token: child}, in pop order

    def add(self, parent: int, token: int) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.children.setdefault(parent, {})[token] = node
        return node

    def best_chain(self, node: int) -> list[int]:
        """`node`, then its first-popped (most likely) child, and so on to a leaf."""
        chain = [node]
        while self.children.get(chain[-1]):
            chain.append(next(iter(self.children[chain[-1]].values())))
        return chain

    def visible(self) -> torch.Tensor:
        """[n, n] bool: node i sees node j (j is i or one of its ancestors)."""
        n = len(self.tokens)
        seen = torch.eye(n, dtype=torch.bool)
        for node in range(1, n):
            seen[node] |= seen[self.parents[node]]
        return seen


def grow_tree(slot_logits: torch.Tensor, anchor_id: int, budget: int) -> DraftTree:
    """The tree of `budget` nodes over the drafted slots' logits [L, V]."""
    top = min(budget, slot_logits.shape[-1])
    logprobs, ids = torch.log_softmax(slot_logits.float(), dim=-1).topk(top, dim=-1)
    tree, candidate_ids = DraftTree([anchor_id]), ids.tolist()
    nodes: dict[tuple[int, ...], int] = {(): 0}
    for ranks in islice(best_first_tree(logprobs.tolist()), budget):
        nodes[ranks] = tree.add(nodes[ranks[:-1]], candidate_ids[len(ranks) - 1][ranks[-1]])
    return tree


def verification_method(model) -> str:
    """What `verify_tree` runs on this target model (module docstring), from its cache layout."""
    return "tree_attention" if tree_maskable(model) else "chains"


def verify_tree(target, tree: DraftTree, start: int) -> tuple[list[int], torch.Tensor]:
    """(accepted path tokens + the bonus, features [accepted + 1, F] of the anchor and the
    path) with the target's cache holding the anchor and the accepted path after it."""
    if target.tree_maskable():
        return _verify_with_tree_attention(target, tree, start)
    return _verify_with_chains(target, tree, start)


def _verify_with_tree_attention(target, tree: DraftTree, start: int):
    logits, features = target.forward_tree(torch.tensor(tree.tokens), tree.depths, tree.visible())
    choices = logits.argmax(dim=-1).tolist()
    path, node = [0], 0
    while (child := tree.children.get(node, {}).get(choices[node])) is not None:
        path.append(child)
        node = child
    target.keep_nodes(start, path)
    return [tree.tokens[i] for i in path[1:]] + [choices[node]], features[path]


def _verify_with_chains(target, tree: DraftTree, start: int):
    new: list[int] = []
    kept = []
    node, position = 0, start
    while True:
        chain = tree.best_chain(node)
        target.save()
        logits, features = target.forward(torch.tensor([tree.tokens[i] for i in chain]), features=True)
        choices = logits.argmax(dim=-1).tolist()
        step = 0  # chain[step] is the deepest node the target has followed so far
        while step + 1 < len(chain) and tree.tokens[chain[step + 1]] == choices[step]:
            step += 1
        target.keep(position, torch.tensor([tree.tokens[i] for i in chain]), step + 1)
        kept.append(features[: step + 1])
        new += [tree.tokens[i] for i in chain[1 : step + 1]]
        position += step + 1
        branch = tree.children.get(chain[step], {}).get(choices[step])
        if branch is None:
            return new + [choices[step]], torch.cat(kept)
        new.append(tree.tokens[branch])
        node = branch
