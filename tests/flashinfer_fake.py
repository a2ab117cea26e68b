"""A stand-in for FlashInfer's paged wrappers that runs on the CPU: every call is bound to the
real flashinfer-python signature (when the package imports; it does with CPU torch), checked
against the tensor contract the docs state, and answered with a reference computation, so the
FlashInfer backend's page tables, slot writes and masks are checked end to end on a CPU.

Contract per plan: `indptr` int32 [n + 1] from 0, non-decreasing; `indices` int32 [indptr[-1]];
`last_page_len` int32 [n] in 1..page_size; all three on the host; query heads a multiple of KV
heads. Per run: the cache is 5-D NHD [pages, 2, page_size, kv_heads, head_dim] and q is
[rows, heads, head_dim] in the planned dtype. Causal masks are bottom-right aligned (the last
query row sees the whole sequence); `window_left` keys to the left of a row stay visible.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

try:  # the real package, for its signatures only
    import flashinfer as real_flashinfer
except Exception:  # noqa: BLE001 - not installed, or fails to import: contracts only
    real_flashinfer = None


def _bind(real_cls: str, method: str, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """Bind a call to the real method's signature (raises TypeError on a mismatch)."""
    if real_flashinfer is None:
        raise RuntimeError("flashinfer is not importable")
    fn = getattr(getattr(real_flashinfer, real_cls), method)
    return inspect.signature(fn).bind(None, *args, **kwargs)


class Calls:
    """Everything the fakes saw, for assertions."""

    wrappers: list[_Wrapper] = []
    plans: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []

    @classmethod
    def reset(cls) -> None:
        cls.wrappers, cls.plans, cls.runs = [], [], []


def check_page_table(indptr, indices, last_page_len, page_size: int) -> None:
    for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
        assert isinstance(t, torch.Tensor), f"{name} is not a tensor"
        assert t.dtype == torch.int32, f"{name} is {t.dtype}, not int32"
        assert t.device.type == "cpu", f"{name} is on {t.device}: plan would copy it back"
        assert t.dim() == 1, f"{name} is not 1-D"
    assert len(indptr) == len(last_page_len) + 1
    assert int(indptr[0]) == 0 and bool((indptr[1:] >= indptr[:-1]).all())
    assert int(indptr[-1]) == len(indices)
    assert bool((last_page_len >= 1).all()) and bool((last_page_len <= page_size).all()), (
        f"last_page_len {last_page_len.tolist()} outside 1..{page_size}"
    )


class _Wrapper:
    REAL = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _bind(self.REAL, "__init__", args, kwargs) if real_flashinfer else None
        workspace = bound.arguments["float_workspace_buffer"] if bound else args[0]
        layout = bound.arguments.get("kv_layout", "NHD") if bound else "NHD"
        assert layout == "NHD", layout
        self.workspace = workspace
        self.kwargs = dict(bound.arguments) if bound else kwargs
        self.plan_args: dict[str, Any] | None = None
        Calls.wrappers.append(self)

    def _record_plan(self, arguments: dict[str, Any], qo_indptr: torch.Tensor | None) -> None:
        page_size = arguments["page_size"]
        check_page_table(
            arguments["indptr"], arguments["indices"], arguments["last_page_len"], page_size
        )
        if qo_indptr is not None:
            assert qo_indptr.dtype == torch.int32 and qo_indptr.device.type == "cpu"
            assert len(qo_indptr) == len(arguments["indptr"])
        assert arguments["num_qo_heads"] % arguments["num_kv_heads"] == 0
        self.plan_args = dict(arguments, qo_indptr=qo_indptr)
        Calls.plans.append({"wrapper": self, **self.plan_args})

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor, *args: Any, **kwargs: Any):
        if real_flashinfer:
            _bind(self.REAL, "run", (q, paged_kv_cache, *args), kwargs)
        p = self.plan_args
        assert p is not None, "run before plan"
        cache = paged_kv_cache
        assert isinstance(cache, torch.Tensor) and cache.dim() == 5, "not one 5-D NHD cache"
        assert cache.shape[1] == 2 and cache.shape[2] == p["page_size"]
        assert cache.shape[3] == p["num_kv_heads"] and cache.shape[4] == p["head_dim"]
        assert q.dim() == 3 and q.shape[1:] == (p["num_qo_heads"], p["head_dim"])
        assert q.dtype == p.get("q_data_type", q.dtype), (q.dtype, p.get("q_data_type"))
        Calls.runs.append({"wrapper": self, "q": q.shape, "cache": cache.shape})
        return reference_attention(q, cache, p)


def reference_attention(q: torch.Tensor, cache: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    indptr, indices, last = p["indptr"].tolist(), p["indices"], p["last_page_len"].tolist()
    bs, n = p["page_size"], len(last)
    qo = p["qo_indptr"].tolist() if p["qo_indptr"] is not None else list(range(n + 1))
    window = p.get("window_left", -1)
    window = -1 if window is None else window
    scale = p.get("sm_scale") or 1.0 / math.sqrt(p["head_dim"])
    group = p["num_qo_heads"] // p["num_kv_heads"]
    out = torch.empty_like(q)
    for i in range(n):
        pages = indices[indptr[i] : indptr[i + 1]].long()
        seq_len = (len(pages) - 1) * bs + last[i]
        k = cache[pages, 0].reshape(-1, *cache.shape[3:])[:seq_len].float()
        v = cache[pages, 1].reshape(-1, *cache.shape[3:])[:seq_len].float()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        rows = q[qo[i] : qo[i + 1]].float()
        q_pos = torch.arange(seq_len - len(rows), seq_len)[:, None]  # bottom-right
        k_pos = torch.arange(seq_len)[None, :]
        keep = k_pos <= q_pos
        if window >= 0:
            keep &= k_pos >= q_pos - window
        s = torch.einsum("qhd,khd->hqk", rows, k) * scale
        s = s.masked_fill(~keep[None], float("-inf"))
        out[qo[i] : qo[i + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
    return out


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    REAL = "BatchDecodeWithPagedKVCacheWrapper"

    def plan(self, *args: Any, **kwargs: Any) -> None:
        # plan(...) takes **kwargs and forwards them to _plan_impl: bind to that, keyword-checked
        if real_flashinfer:
            arguments = dict(_bind(self.REAL, "_plan_impl", args, kwargs).arguments)
            assert not arguments.get("kwargs"), f"unknown plan arguments {arguments['kwargs']}"
        else:
            names = ["indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads"]
            arguments = dict(zip([*names, "head_dim", "page_size"], args), **kwargs)
        self._record_plan(arguments, None)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    REAL = "BatchPrefillWithPagedKVCacheWrapper"

    def plan(self, *args: Any, **kwargs: Any) -> None:
        if real_flashinfer:
            a = dict(_bind(self.REAL, "plan", args, kwargs).arguments)
        else:
            names = ["qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"]
            a = dict(
                zip([*names, "num_qo_heads", "num_kv_heads", "head_dim_qk", "page_size"], args)
            )
            a.update(kwargs)
        assert a.get("causal") is True, "prefill must be causal"
        arguments = dict(
            a,
            indptr=a["paged_kv_indptr"],
            indices=a["paged_kv_indices"],
            last_page_len=a["paged_kv_last_page_len"],
            head_dim=a["head_dim_qk"],
        )
        self._record_plan(arguments, a["qo_indptr"])


def install(monkeypatch) -> None:
    """Make `import flashinfer` inside the backend find these fakes."""
    import sys
    import types

    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    Calls.reset()
