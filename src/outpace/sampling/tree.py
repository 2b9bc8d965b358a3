"""Verification of token trees: the longest path whose every node is the target's own token.

Shapes: B rows, K draft nodes (padded), S = K + 1 row positions (position 0: the row's last token,
the tree's root; position j + 1: node j).
  target_tokens [B, S] int64: the token the target emits after each row position: its argmax
                (greedy), or its sample with the position's noise (seeded sampling: every node of
                one depth shares that output position's u, so the sample is the one plain
                sampling would draw there given the path).
  draft_tokens  [B, K] int64, parents [B, K] int64 (node j's parent node, < j, or -1 for the
                root), num_draft [B]: nodes at j >= num_draft[b] are padding.
Rule: from the root, move to a child whose token equals the target's token at the current node
(the first such child in node order; children with equal tokens carry the same prefix, so any
would do), while there is one; then emit the target's token at the node reached. Every emitted
token is the target's own at a path it would have taken itself, so greedy output is plain greedy
output and seeded sampled output is plain seeded sampling's, token for token; a chain (parents
j - 1) reduces to rejection.verify_greedy.
Outputs: out_tokens [B, S] (out_tokens[b, :num_out[b]] are appended), num_out [B] in
[1, depth + 1], path [B, K] (path[b, d] the row position of the node accepted at depth d + 1,
for the cache's compaction; entries at d >= num_out[b] - 1 are 0).
No host synchronisation: a loop over depths in Python, tensor math over rows.
"""
from __future__ import annotations

import torch


def tree_depths(parents: list[int], width: int) -> list[int]:
    """Each row position's depth below the root (the root 0), for a row of `width` nodes after the
    root: nodes past the tree (padding) get the depth of their index, never read."""
    depth = [0]
    for parent in parents:
        depth.append(depth[parent + 1] + 1)
    return depth + list(range(len(depth), width + 1))


def verify_tree(target_tokens: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor,
                num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, K = draft_tokens.shape
    device = draft_tokens.device
    nodes = torch.arange(K, device=device)
    is_node = nodes[None, :] < num_draft[:, None]                                    # [B, K]
    at = torch.zeros(B, dtype=torch.long, device=device)                             # current row position
    alive = torch.ones(B, dtype=torch.bool, device=device)
    out = torch.zeros(B, K + 1, dtype=torch.long, device=device)
    path = torch.zeros(B, K, dtype=torch.long, device=device)
    num_accepted = torch.zeros(B, dtype=torch.long, device=device)
    for d in range(K + 1):
        token = target_tokens.gather(1, at[:, None]).squeeze(1)                       # [B]
        out[:, d] = torch.where(alive, token, out[:, d])
        if d == K:
            break
        # children of the current node carrying the target's token
        match = is_node & (parents + 1 == at[:, None]) & (draft_tokens == token[:, None]) & alive[:, None]
        found = match.any(-1)
        child = match.long().argmax(-1) + 1                                           # its row position
        alive = alive & found
        path[:, d] = torch.where(alive, child, 0)
        at = torch.where(alive, child, at)
        num_accepted += alive.long()
    return out, num_accepted + 1, path


def tree_ancestors(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Each node's ancestors and itself [B, K, K] (bool; [b, j, i]: node i is node j or on its path)
    from parents [B, K] (-1 for the root's children) of trees at most max_depth deep. Static
    shapes and no host read (inside CUDA graphs): max_depth - 1 gathers, node j's row its
    parent's row plus itself."""
    B, K = parents.shape
    own = torch.eye(K, dtype=torch.bool, device=parents.device).expand(B, K, K)
    rows = torch.where(parents < 0, K, parents)[:, :, None].expand(B, K, K)      # the root's: a row of zeros
    ancestors = own
    for _ in range(max_depth - 1):
        padded = torch.cat([ancestors, ancestors.new_zeros(B, 1, K)], dim=1)
        ancestors = own | padded.gather(1, rows)
    return ancestors


def verify_tree_paths(target_tokens: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor,
                      ancestors: torch.Tensor, depth: torch.Tensor, is_node: torch.Tensor):
    """verify_tree's outputs (out_tokens [B, S], num_out [B], path [B, K]) for greedy trees whose
    nodes come in order of depth (a parent before its children, every depth's nodes after the
    one above's), at a fixed number of operations whatever the tree's size, for CUDA graphs:
    a node is accepted where it and each of its ancestors (ancestors, tree_ancestors') is a node
    (is_node [B, K]) carrying the target's token at its parent; the path kept is the deepest
    accepted node's (the first in node order among equally deep ones), and the target's tokens
    along it are emitted. Siblings of distinct tokens (a head's top candidates) leave one path of
    accepted nodes, verify_tree's; where they repeat a token, any path taken emits the same tokens.
    depth [B, K]: each node's depth (1 below the root)."""
    B, K = draft_tokens.shape
    device = draft_tokens.device
    at_parent = target_tokens.gather(1, parents + 1)                                  # [B, K]
    right = is_node & (draft_tokens == at_parent)
    accepted = ~(ancestors & ~right[:, None, :]).any(-1)                              # [B, K]
    order = torch.arange(K, device=device)
    key = torch.where(accepted, depth * (K + 1) + (K - order), -1)
    deepest = key.argmax(1)                                                           # [B]
    found = accepted.any(1)
    num_out = torch.where(found, depth.gather(1, deepest[:, None]).squeeze(1), 0) + 1
    on_path = ancestors.gather(1, deepest[:, None, None].expand(B, 1, K)).squeeze(1) & found[:, None]
    # a path's nodes in node order are in order of depth: the d-th of them is at depth d + 1
    at = torch.where(on_path, on_path.long().cumsum(1) - 1, K)
    path = torch.zeros(B, K + 1, dtype=torch.long, device=device).scatter_(1, at, (order + 1).expand(B, K))[:, :K]
    out = target_tokens.gather(1, torch.cat([torch.zeros_like(path[:, :1]), path], dim=1))
    return out, num_out, path
