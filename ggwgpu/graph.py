"""Graphs: topological order and reverse-mode autodiff as a graph rewrite (ggml style).

Both walk the graph iteratively: deep graphs must not overflow Python's stack.
"""
from __future__ import annotations

import numpy as np

from . import ops as O
from .ops.matmul import add_to_gradient
from .ops.registry import make_node
from .tensor import ShapeError, Tensor, constant, zeros


def sources(t: Tensor) -> list[Tensor]:
    deps = list(t.srcs)
    if t.view_src is not None and t.view_src not in deps:
        deps.append(t.view_src)
    return deps


def topo_order(outputs) -> list[Tensor]:
    """Every tensor the outputs depend on, each after its sources (and view sources).

    A node that writes into another tensor (cpy, optimizer updates: the node is a view of its
    destination) also comes after every node that reads that destination, directly or
    through views of it, without depending on the write: a parameter is updated only once
    everything that reads its old value has run. Writes into different views of one storage
    are ordered only by their dependencies, as in ggml.

    Linear in the graph's size: the readers of a destination come from one index of readers
    and views built once, not from a scan of the whole graph per write. Only a reader that
    comes after the write in a first order without these edges, and does not read the
    write's result, costs a search from the write (bounded by that order); the llama
    training and decode graphs have none.
    """
    order = _depth_first(outputs, {})
    writers = [t for t in order if t.view_src is not None and not O.OPS[t.op].is_view]
    if not writers:
        return order
    pos = {id(t): i for i, t in enumerate(order)}
    readers, views, users = {}, {}, {}  # tensor -> nodes reading it, its views, its dependents
    for t in order:
        for s in dict.fromkeys(t.srcs):
            readers.setdefault(id(s), []).append(t)
        for s in sources(t):
            users.setdefault(id(s), []).append(t)
        if t.view_src is not None:
            views.setdefault(id(t.view_src), []).append(t)
    return _depth_first(outputs, {id(w): _readers_before(w, readers, views, users, pos)
                                  for w in writers})


def _readers_before(w: Tensor, readers, views, users, pos) -> list[Tensor]:
    """The nodes that read w's destination (or a view of it) and do not depend on w, in the
    order of `pos` (a topological order): they must run before w."""
    found, todo = {}, [w.view_src]
    while todo:  # the destination and its views, except what is seen through w itself
        t = todo.pop()
        for n in readers.get(id(t), ()):
            found[id(n)] = n
        todo += [v for v in views.get(id(t), ()) if v is not w]
    # a node placed before w cannot depend on it; one placed after may, through a view of
    # w's result (cheap to see) or through other nodes (a search from w, bounded by pos)
    unsure = {k: n for k, n in found.items() if pos[k] > pos[id(w)] and not reads_through(n, w)}
    if unsure:
        limit, todo, seen = max(pos[k] for k in unsure), [w], {id(w)}
        while todo:
            for u in users.get(id(todo.pop()), ()):
                if id(u) not in seen and pos[id(u)] <= limit:
                    seen.add(id(u))
                    todo.append(u)
        unsure = {k: n for k, n in unsure.items() if k not in seen}
    return sorted((n for k, n in found.items() if pos[k] < pos[id(w)] or k in unsure),
                  key=lambda n: pos[id(n)])


def reads_through(n: Tensor, w: Tensor) -> bool:
    """Whether n reads w's result or a view (of a view ...) of it."""
    for s in n.srcs:
        while s is not None:
            if s is w:
                return True
            s = s.view_src
    return False


REDUCTION = 16   # a kernel whose result is this many times smaller than what it reads


def _depth_first(outputs, extra: dict) -> list[Tensor]:
    """A topological order: the post-order of a depth-first walk (`extra` adds ordering
    edges {id(node): [before]}), except that a node that frees memory runs as soon as its
    last source has run: a view, or a node that is the last reader of storage at least as
    large as its own result. That is what makes gradient checkpointing pay: a weight
    gradient (out_prod of a recomputed activation and the gradient above it) runs right
    after its layer's backward instead of when the optimizer asks for it, so a segment's
    recomputed activations die before the next segment is recomputed."""
    deps, users, nodes = {}, {}, []
    stack = list(outputs)
    while stack:  # every tensor the outputs depend on
        t = stack.pop()
        if id(t) in deps:
            continue
        nodes.append(t)
        deps[id(t)] = list({id(s): s for s in sources(t) + extra.get(id(t), [])}.values())
        for s in deps[id(t)]:
            users.setdefault(id(s), []).append(t)
            stack.append(s)
    waiting = {k: len(v) for k, v in deps.items()}
    keep = {id(t.storage) for t in outputs}
    readers, left_to_read = {}, {}  # storage -> its reading kernels, how many still to run
    for t in nodes:
        if _is_kernel(t):
            for r in _read_roots(t):
                readers.setdefault(id(r), []).append(t)
                left_to_read[id(r)] = left_to_read.get(id(r), 0) + 1
    depth, left = {}, dict(waiting)  # depth: longest path from a leaf (Kahn's order)
    ready = [t for t in nodes if not left[id(t)]]
    while ready:
        t = ready.pop()
        depth[id(t)] = 1 + max((depth[id(s)] for s in deps[id(t)]), default=0)
        for u in users.get(id(t), ()):
            left[id(u)] -= 1
            if not left[id(u)]:
                ready.append(u)
    order, done, open_ = [], set(), set()

    def frees_memory(u) -> bool:
        if not _is_kernel(u):
            return u.op is not None  # a view: free
        read = [r for r in _read_roots(u) if r.op is not None and id(r) not in keep]
        freed = sum(r.nelements * r.np_dtype.itemsize for r in read if left_to_read[id(r)] == 1)
        cost = 0 if u.view_src is not None else u.nelements * u.np_dtype.itemsize
        if freed > 0 and freed >= cost:
            return True
        # a reduction (a LoRA pair's A x, its weight gradients) costs next to nothing to keep
        # and, left for the optimizer to ask for, would keep what it reads alive to the end
        return 0 < cost * REDUCTION <= sum(r.nelements * r.np_dtype.itemsize for r in read)

    def emit(t):
        ready, queued = [t], {id(t)}
        while ready:
            t = ready.pop()
            open_.discard(id(t))
            done.add(id(t))
            order.append(t)
            candidates = []
            for u in users.get(id(t), ()):
                waiting[id(u)] -= 1
                candidates.append(u)
            if _is_kernel(t):
                for r in _read_roots(t):
                    left_to_read[id(r)] -= 1
                    if left_to_read[id(r)] == 1:  # its last reader may free it now
                        candidates += readers[id(r)]
            for u in reversed(candidates):
                if (not waiting[id(u)] and id(u) not in done and id(u) not in queued
                        and frees_memory(u)):
                    queued.add(id(u))
                    ready.append(u)

    stack = [(t, False) for t in reversed(list(outputs))]
    while stack:
        t, expanded = stack.pop()
        if id(t) in done:
            continue
        if expanded:
            emit(t)
            continue
        if id(t) in open_:
            raise ShapeError(f"{t}: in-place writes make the graph cyclic (a tensor is "
                             "written while a value computed from its old contents is needed)")
        open_.add(id(t))
        stack.append((t, True))
        # deepest source last on the stack, so walked first: a backward node first gets the
        # gradient from the layers above, then what it recomputes from a checkpoint
        stack.extend((s, False) for s in sorted(deps[id(t)], key=lambda s: depth.get(id(s), 0))
                     if id(s) not in done)
    return order


def _is_kernel(t: Tensor) -> bool:
    return t.op is not None and not O.OPS[t.op].is_view


def _read_roots(t: Tensor) -> list[Tensor]:
    """The storage owners a kernel reads (its sources' storage, each once)."""
    return list({id(s.storage): s.storage for s in t.srcs}.values())


def recompute_from(order, checkpoints=None, recompute=()) -> dict[int, Tensor]:
    """For gradient checkpointing: a copy of every forward node that recomputes it from the
    nearest checkpoints (or leaves), so that only checkpoints stay alive for the backward.
    Without checkpoints only the nodes in `recompute` and the nodes that use them get such a
    copy; the rest stays as the forward left it."""
    keep = {id(t) for t in checkpoints} if checkpoints is not None else None
    redo = {id(t) for t in recompute}
    # What no checkpoint depends on (the head: final norm, logits, loss) is what the
    # backward starts with, right after the forward made it: recomputing it would only
    # double its work (for a llama, the largest product of the step)
    below = set() if keep is None else set(keep)
    for t in reversed(order):
        if id(t) in below:
            below.update(id(s) for s in sources(t))
    copies = {}
    for t in order:  # topological: sources are mapped before their users
        unchanged = id(t) not in redo and all(copies[id(s)] is s for s in t.srcs)
        if keep is None:
            kept = unchanged
        else:
            kept = id(t) in keep or (id(t) not in below and unchanged)
        if t.op is None or kept:
            copies[id(t)] = t
        else:
            srcs = [copies[id(s)] for s in t.srcs]
            copies[id(t)] = make_node(O.OPS[t.op], srcs, t.params)
    return copies


def backward_node(node: Tensor, copies) -> Tensor:
    """The node a backward rule sees: its recomputed copy, and for a checkpoint (kept, its
    sources recomputed) a twin that reads the recomputed sources, so that what the rule
    reads of them (a product's operands) does not keep the forward's alive to the backward.
    A rule that reads the node's own value then reads the twin's, computed again."""
    if not copies:
        return node
    twin = copies[id(node)]
    if twin is node and any(copies[id(s)] is not s for s in node.srcs):
        twin = make_node(O.OPS[node.op], [copies[id(s)] for s in node.srcs], node.params)
    return twin


def build_backward(loss: Tensor, params=None, checkpoints=None,
                   recompute=(), seed: Tensor | None = None) -> dict[Tensor, Tensor]:
    """Gradient tensors of `loss` (one element) with respect to `params`.

    params defaults to every leaf marked `is_param` that the loss depends on. The gradient
    of a tensor used several times is the sum of its uses (a new node per use, never in
    place: an add, or the product that makes the new term adding the sum in its epilogue,
    ops.matmul.add_to_gradient). Returns {param: gradient}, each gradient shaped like its
    param.

    checkpoints: forward tensors to keep for the backward (gradient checkpointing, as ggml's
    build_backward_gradient_checkpointing); every other forward value the backward needs is
    recomputed from them, trading compute for activation memory.

    recompute: forward tensors the backward recomputes from their sources instead of keeping
    them alive until it runs (the row chunks of a large logits tensor: each then lives only
    while its chunk's loss, and later its gradient, is computed). The backward rules of
    their users see the recomputed values (and recompute those users' outputs, if they need
    them).
    """
    if loss.nelements != 1:
        raise ShapeError(f"build_backward: loss must have one element, has shape {loss.shape}")
    order = topo_order([loss])
    if params is None:
        params = [t for t in order if t.is_param]
    params = list(params)
    wanted = {id(p) for p in params}

    # Only tensors between a param and the loss need a gradient; integer tensors (the
    # experts a router picked) carry none, whatever they were computed from.
    needs = set()
    for t in order:
        if t.dtype == "i32":
            continue
        if id(t) in wanted or any(id(s) in needs for s in t.srcs):
            needs.add(id(t))

    copies = (recompute_from(order, checkpoints, recompute)
              if checkpoints is not None or recompute else None)
    if seed is not None and seed.shape != loss.shape:
        raise ShapeError(f"build_backward: seed {seed.shape} differs from the loss's {loss.shape}")
    grads = {id(loss): seed if seed is not None else
             constant(np.ones(loss.shape, np.float32), name="d_loss")}
    forward, fresh = {id(t) for t in order}, set()
    for node in reversed(order):
        g = grads.get(id(node))
        if g is None or node.op is None:
            continue
        fresh.discard(id(g))    # the rule below may hand g on to several sources
        opdef = O.OPS[node.op]
        if opdef.backward is None:
            raise ShapeError(f"{node.op} is an optimizer update and cannot be differentiated")
        src_grads = opdef.backward(backward_node(node, copies), g)
        for i, (src, sg) in enumerate(zip(node.srcs, src_grads)):
            if id(src) not in needs:
                continue
            if i in opdef.no_grad:
                raise ShapeError(f"{node.op}: input {i} {src.shape} takes no gradient "
                                 "(ids, positions; second derivatives of *_back ops)")
            if sg is None:  # the gradient is zero
                continue
            if sg.shape != src.shape:
                raise ShapeError(f"{node.op}: backward gave {sg.shape} for input {src.shape}")
            if sg.dtype != src.dtype and not src.is_quantized:
                sg = O.cast(sg, src.dtype)   # a gradient has its tensor's type (f16 graphs)
            prev = grads.get(id(src))
            # a term the rule made for this sum alone (not g, no forward node, no source of
            # another of its terms) may take the sum into its own kernel
            if (sg is not g and id(sg) not in forward and not any(
                    o is not None and o is not sg and sg in o.srcs for o in src_grads)):
                fresh.add(id(sg))
            grads[id(src)] = sg if prev is None else add_to_gradient(
                prev, sg, id(prev) in fresh, id(sg) in fresh)

    out = {}
    for p in params:
        g = grads.get(id(p))
        out[p] = g if g is not None else zeros(p.shape)
    return out
