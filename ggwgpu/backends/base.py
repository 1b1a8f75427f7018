"""What both backends share: planning a graph's storage, feeding and checking values."""
from __future__ import annotations

import weakref

import numpy as np

from ..alloc import Block, Layout, pack
from ..graph import sources, topo_order
from ..ops import OPS
from ..quant import Quantized, storage_bytes
from ..tensor import ShapeError, Tensor


class DeviceLimitError(ShapeError):
    """A tensor is larger than the device allows; raised while planning, before any buffer
    is made or anything dispatched."""

# Guard elements: NaNs with payloads that no kernel produces, by element size in bytes.
SENTINEL_BITS = {2: 0x7EEF, 4: 0x7FC0BEEF, 8: 0x7FF80000DEADBEEF}


def guarded_block(n: int, sentinel: int, dtype) -> np.ndarray:
    """A zeroed storage block of n elements with `sentinel` guard elements on each side."""
    dtype = np.dtype(dtype)
    block = np.zeros(n + 2 * sentinel, dtype)
    bits = block.view(f"u{dtype.itemsize}")
    bits[:sentinel] = bits[len(bits) - sentinel:] = SENTINEL_BITS[dtype.itemsize]
    return block


class SharedConstant:
    """The storage of one constant leaf's value, in its backend's form (a NumPy block, a
    wgpu buffer), held by the plans of that backend that use the value: it lives as long as
    one of them does (SharedConstants holds it weakly)."""

    def __init__(self, value, storage, nbytes: int):
        self.value = value      # held, so that no other object takes its id (the key)
        self.storage = storage
        self.nbytes = nbytes
        self.dense = None       # NumPy: a block-type value dequantized, once for all plans


class SharedConstants:
    """A backend's constant storage, one per constant value, shared by its plans.

    A constant leaf that a plan never writes (Plan.constant_keys) is uploaded once per
    backend: plans whose leaves have the same value object (the weights of the graphs that
    one `values` dict builds, which constant() keeps as they are) share its storage. The key
    is that object's identity, not its content: constants are fixed, so an array changed in
    place after a plan was made from it reaches no plan of the backend (hashing the content
    would cost a pass over every weight per plan). An entry goes when its last plan does."""

    def __init__(self):
        self._live = weakref.WeakValueDictionary()

    def get(self, root: Tensor, nbytes: int, upload) -> SharedConstant:
        """The shared storage of constant `root`; `upload(root)` makes it the first time."""
        key = (id(root.value), root.dtype, root.shape)
        shared = self._live.get(key)
        if shared is None:
            shared = self._live[key] = SharedConstant(root.value, upload(root), nbytes)
        return shared

    def __len__(self) -> int:
        return len(self._live)

    def nbytes(self) -> int:
        """The bytes of the constant storage the backend holds now."""
        return sum(s.nbytes for s in list(self._live.values()))


class Plan:
    """A graph planned once for a backend, then run any number of times.

    Storage is planned when the plan is made: one block per storage-owning tensor, blocks
    with disjoint lifetimes sharing a buffer (storage_layout), and `sentinel` guard elements
    on both sides of each (tests fill them and check nothing wrote there; sentinels turn
    sharing off). Leaves with a value (params, constants) are uploaded once; inputs come
    with each run. Constants the plan never writes take their storage from the backend's
    SharedConstants (`constants`), shared with its other plans; a write() to one first
    gives the plan a copy of its own (params and inputs are never shared). So do the
    constant leaves named in `shared` that its nodes write: state that the plans of graphs
    built on the same value hold in common, each run's writes seen by the others (a
    decoder's caches).
    """

    def __init__(self, outputs, sentinel: int = 0, shared=()):
        self.outputs = list(outputs)
        self.order = topo_order(self.outputs)
        # a multiple of 4 elements: storage then starts 16-byte aligned for vec4 kernels
        self.sentinel = -(-int(sentinel) // 4) * 4
        self.roots = []
        seen = set()
        for t in self.order:
            root = t.storage
            if id(root) not in seen:
                seen.add(id(root))
                self.roots.append(root)
        self.nodes = [t for t in self.order if t.op is not None and not OPS[t.op].is_view]
        self._known = {id(t) for t in self.order}
        written = set()
        for node in self.nodes:
            written.add(id(node.storage))
            if OPS[node.op].updates:    # an optimizer step writes its sources in place
                written.update(id(s.storage) for s in node.srcs)
        # the leaves whose storage may be shared with the backend's other plans: constants
        # that no node writes (not params, which the optimizer updates, nor inputs) or that
        # `shared` names; none with sentinels, whose guards a test checks plan by plan
        written -= {id(t.storage) for t in shared}
        self.constant_keys = set() if self.sentinel else {
            id(r) for r in self.roots
            if r.op is None and r.value is not None and not r.is_param and id(r) not in written}
        self.constants = {}     # id(root) -> SharedConstant, for those the plan shares now
        self._shared = set()    # storage keys whose bytes another block reuses
        self._staged = set()    # indexes of the nodes that stage() gave out
        self.layout = None      # the storage layout the backend's plan made, once it made it

    def storage_layout(self, private=(), **packing) -> Layout:
        """Pack the plan's storage blocks (and `private`: (scratch tensor, step) pairs) into
        shared buffers by liveness (alloc.pack, with `packing`'s keywords). Leaves and outputs
        live throughout: they hold values between runs. With sentinels nothing is shared, so
        every guard stays checkable. The constants of `constant_keys` are not in it: their
        storage is the backend's."""
        forever = len(self.nodes) + 1
        first, last = {}, {}
        for step, node in enumerate(self.nodes):
            for t in (node, *node.srcs):
                key = id(t.storage)
                first.setdefault(key, step)
                last[key] = step
        for t in self.order:
            if t.op is None or self.sentinel:
                first[id(t.storage)], last[id(t.storage)] = -1, forever
        for t in self.outputs:
            last[id(t.storage)] = forever
        blocks = [Block(id(r), self.nbytes(r), first.get(id(r), -1), last.get(id(r), forever))
                  for r in self.roots if id(r) not in self.constant_keys]
        blocks += [Block(id(t), self.nbytes(t), step, forever if self.sentinel else step)
                   for t, step in private]
        return pack(blocks, **packing)

    def memory(self, layout: Layout | None = None, scratch=()) -> dict:
        """The planned storage in bytes, by role: weights (params), gradients (the blocks the
        optimizer updates read), state (other leaves with a value: optimizer moments,
        constants), inputs, activations (every other block live at the peak, `scratch`
        tensors included), the peak of live bytes, `planned`, the bytes of the buffers
        `layout` (default: the plan's, else storage_layout()) allocates and of the
        constants, and `shared`, the part of `planned` in constant storage the backend holds
        for all its plans (SharedConstants: other plans of the same values use it too);
        planned_bytes() adds several plans up counting each shared constant once."""
        layout = layout or self.layout or self.storage_layout()
        grads = {id(n.srcs[1].storage) for n in self.nodes if OPS[n.op].updates}
        out = dict.fromkeys(("weights", "gradients", "state", "inputs", "activations"), 0)
        counted = set()     # shared constant storage, counted once (zeros() of one shape)
        for t in self.roots + list(scratch):
            key = id(t)
            if key in self.constants:
                if id(self.constants[key]) in counted:
                    continue
                counted.add(id(self.constants[key]))
            if t.op is None and key in self._known:    # a leaf, not scratch
                role = "weights" if t.is_param else "state" if t.value is not None else "inputs"
            elif key in grads:
                role = "gradients"
            elif key in layout.peak_keys:
                role = "activations"
            else:
                continue
            out[role] += self.nbytes(t)
        shared = sum({id(c): c.nbytes for c in self.constants.values()}.values())
        constants = shared + sum(self.nbytes(r) for r in self.roots
                                 if id(r) in self.constant_keys and id(r) not in self.constants)
        out.update(peak=layout.peak_bytes + constants, planned=layout.total_bytes + constants,
                   shared=shared)
        return out

    def nbytes(self, root: Tensor) -> int:
        """Bytes of root's storage block, guards included, rounded up to whole 4-byte words
        (an odd count of f16 elements; WebGPU copies and binds multiples of 4)."""
        return -(-(root.storage_len + 2 * self.sentinel) * root.storage_dtype.itemsize // 4) * 4

    def quantized_value(self, t: Tensor, block: np.ndarray) -> Quantized:
        """The value of a block-type tensor from its storage block (u32 words, guards
        included). Such tensors are whole constants or reshapes of one (offset 0)."""
        words = block[self.sentinel:self.sentinel + t.storage_len]
        nbytes = storage_bytes(t.dtype, t.nelements)
        return Quantized(t.dtype, t.shape, words.view(np.uint8)[:nbytes])

    def _check_readable(self, t: Tensor):
        key = id(t.storage)
        if key in self._shared and not any(key == id(o.storage) for o in self.outputs):
            raise KeyError(f"{t} is an intermediate whose storage is reused within a run; "
                           "list it among the plan's outputs to read it")

    def _check_value(self, t: Tensor, value) -> np.ndarray:
        if id(t) not in self._known:
            raise KeyError(f"{t} is not part of this plan")
        if t.is_quantized:
            if not (isinstance(value, Quantized) and value.dtype == t.dtype
                    and value.shape == t.shape and t is t.storage):
                raise ShapeError(f"value for {t}: a Quantized {t.dtype} {t.shape} for the "
                                 f"whole tensor expected, got {value!r}")
            return value
        value = np.asarray(value)
        if value.shape != t.shape:
            raise ShapeError(f"value for {t}: shape {value.shape}, expected {t.shape}")
        if t.dtype == "i32" and value.dtype.kind not in "iu":
            raise ShapeError(f"value for {t}: integer data expected, got {value.dtype}")
        return value

    def stage(self, outputs) -> tuple[int, ...]:
        """A part of the plan that runs alone (run(stage=...)): the indexes, in plan order, of
        the nodes that `outputs` need and that no earlier stage of this plan took. The host
        can act between stages (data-parallel training averages the gradients between the
        backward and the optimizer). A stage reads what another computed only from leaves and
        plan outputs, the blocks that keep their values between runs: any other block may
        share its buffer with one the other stage writes."""
        index = {id(n): i for i, n in enumerate(self.nodes)}
        taken = self._staged
        mine, stack, seen = set(), list(outputs), set()
        while stack:
            t = stack.pop()
            if id(t) in seen:
                continue
            seen.add(id(t))
            if id(t) not in self._known:
                raise KeyError(f"{t} is not part of this plan")
            if t.op is None or index.get(id(t)) in taken:
                continue
            if id(t) in index:    # views are no nodes: their sources are
                mine.add(index[id(t)])
            stack.extend(sources(t))
        kept = {id(o.storage) for o in self.outputs}
        for i in mine:
            for s in sources(self.nodes[i]):
                root = s.storage
                if (root.op is not None and index.get(id(root)) not in mine
                        and id(root) not in kept):
                    raise ValueError(f"stage: {self.nodes[i]} reads {root}, which another "
                                     f"stage computes and which is not a plan output")
        self._staged = taken | mine
        return tuple(sorted(mine))

    def run(self, feeds=None, stage=None):
        """Write `feeds` ({input tensor: array}) and compute the whole graph, or only the
        nodes of `stage` (from stage())."""
        raise NotImplementedError

    def read(self, t: Tensor) -> np.ndarray:
        """The current value of `t` (a copy)."""
        raise NotImplementedError

    def read_many(self, tensors) -> list[np.ndarray]:
        """The current values of several tensors; a backend may fetch them in one transfer."""
        return [self.read(t) for t in tensors]

    def write(self, t: Tensor, value, everywhere: bool = False):
        """Overwrite the value of a tensor that owns or views storage (inputs, params). A
        constant this plan shares with others gets a copy of its own first; `everywhere`
        writes the shared storage instead, for every plan (a Decoder's recurrent states)."""
        raise NotImplementedError

    def read_raw(self, root: Tensor) -> np.ndarray:
        """The whole storage block of `root`, sentinels included."""
        raise NotImplementedError

    def stray_writes(self) -> list[Tensor]:
        """Storage blocks whose sentinel guard elements were overwritten (for tests)."""
        s = self.sentinel
        if not s:
            return []
        stray = []
        for root in self.roots:
            raw = self.read_raw(root)
            bits = raw.view(f"u{raw.itemsize}")
            if not (np.all(bits[:s] == SENTINEL_BITS[raw.itemsize])
                    and np.all(bits[-s:] == SENTINEL_BITS[raw.itemsize])):
                stray.append(root)
        return stray


def same_storage(plan: Plan, t: Tensor, other: Plan, other_t: Tensor) -> bool:
    """Whether leaf t of `plan` and leaf other_t of `other` are one shared storage."""
    shared = plan.constants.get(id(t.storage))
    return shared is not None and shared is other.constants.get(id(other_t.storage))


def planned_bytes(plans) -> int:
    """The storage several plans of one backend take together: each plan's own, and each
    constant they share once."""
    own = sum(m["planned"] - m["shared"] for m in (p.memory() for p in plans))
    shared = {id(s): s.nbytes for p in plans for s in p.constants.values()}
    return own + sum(shared.values())


class Backend:
    """Makes plans; holds the constant storage its plans share (`constants`).

    What a backend offers the code that builds graphs for it, set by every backend:

        has_f16         f16 element tensors compute in device kernels (wgpu: the adapter's
                        shader-f16), so precision `auto` picks f16 (backends.precision_for)
        emulates_f16    f16 element tensors are stored as halves and computed in f32, to
                        compare with a device (NumPy); `auto` never picks f16 for it
        storage_limits  {WebGPU limit name: bytes} that a storage block must fit
                        (max-storage-buffer-binding-size, max-buffer-size); empty where only
                        the host's memory bounds it
        kernel_variants {shader family: kernel variant} (kernels.choose_variants); empty
                        where ops run no shaders (each op's first variant is then meant)
        info            names the device: "device" always, plus the WebGPU adapter's info
                        (adapter_type, backend_type, vendor, ...) where there is one
    """
    name = "?"
    constants: SharedConstants
    has_f16: bool
    emulates_f16: bool
    storage_limits: dict[str, int]
    kernel_variants: dict[str, str]
    info: dict

    def plan(self, outputs, sentinel: int = 0, shared=()) -> Plan:
        raise NotImplementedError

    def compute(self, outputs, feeds=None) -> list[np.ndarray]:
        """Plan, run once and read every output: convenient, not for loops."""
        plan = self.plan(outputs)
        plan.run(feeds)
        return [plan.read(t) for t in outputs]
