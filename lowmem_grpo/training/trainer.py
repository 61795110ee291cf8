"""The GRPO training loop: `Trainer` sets up the run, takes one optimizer step (`optimizer_step`) and
runs the loop (`train`):

    sample prompts -> generate G completions each -> rewards -> advantages
    -> (old log-probs if the policy moves while the batch is in use; reference log-probs if beta > 0)
    -> loss on micro-batches through the fused head -> optimizer step -> log -> checkpoint

One device per process; under torchrun every rank runs this loop on its own slice of the prompts.

Design notes: docs/training.md, docs/distributed.md
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from ..config import Config, ConfigError, batch_plan, rollout_engine
from ..phases import phase
from ..policy.layer_major import decoder_layers
from ..policy.model import load_tokenizer
from ..policy.streaming import host_table, look_up_on_host, stream_trained_layers
from ..policy.batch import Batch
from ..transfers import TRANSFERS
from . import checkpoint as ckpt
from . import distributed
from . import output_dir
from .callbacks import as_callback, notify
from .compiled_layers import compiled_layers
from .context import RolloutContext
from .evaluate import evaluate, evaluated_steps, evaluation_after, evaluation_before, evaluation_during
from .generation import GenerationBatch, make_generation_batch, make_trainer_state
from .micro_batch import computed_tokens, plan_micro_batch, step_completion_tokens
from .metrics import (NullLog, RunLog, StepTally, StepTotals, peak_memory_bytes, reset_peak_memory, step_means,
                      trl_names)
from .plot import save_run_plot
from .step_modes import (head_gradient_once, layer_major_wanted, layers_per_checkpoint, make_step_mode,
                         offload_weights)
from .setup import (pick_device, seed_everything, setup_data, setup_loss, setup_model, setup_optimizer, setup_output,
                    setup_precision, setup_reference, setup_rewards, setup_training_model, setup_world, special_ids)
from .stopping import RunOutOfMemory, StopRequest, out_of_memory_message, save_on_error

logger = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The run stopped early on purpose (non-finite steps); a checkpoint was saved."""


class Trainer:
    # A folder holding another run is refused before anything loads; the Python API checks it in train(),
    # where TRL's train(resume_from_checkpoint=...) says whether the run continues it.
    checks_previous_run_at_setup = True

    @output_dir.released_on_error
    def __init__(self, cfg: Config, recipe_dir: Optional[str | Path] = None, training: bool = True, *,
                 model=None, tokenizer=None, reward_funcs: Optional[list] = None, train_data=None, eval_data=None,
                 callbacks: Optional[list] = None, reward_processing_classes: Optional[list] = None):
        """Load tokenizer, rewards, model and data; with training=False stop there (evaluation only). Training
        first claims output_dir (output_dir.py: OutputDirError for another run's folder, a live run's, or one
        it cannot write) and verifies resume_from's checkpoint, before anything loads. Each step is one
        set-up function of setup.py, whose contract says what must come before it.

        From Python (lowmem_grpo.api) any of them may be given as objects instead, and replace what `cfg`
        names: a loaded model and tokenizer, reward functions (callables and loaded reward models mixed with
        what a recipe names) and their tokenizers, and the rows as a datasets.Dataset or list of dicts
        (data.train_file / eval_file may then be empty)."""
        self.cfg, m, t, g = cfg, cfg.model, cfg.train, cfg.generation
        self.callbacks = [as_callback(c) for c in callbacks or []]
        self.recipe_dir = None if recipe_dir is None else Path(recipe_dir)
        self.world, rank_device = setup_world(cfg, training)
        self.output_lock, resume = setup_output(cfg.output, self.world, training, self.checks_previous_run_at_setup)
        self.plan = batch_plan(cfg, self.world.size)
        self.device = pick_device(rank_device or t.device)
        seed_everything(t.seed)
        self.autocast = setup_precision(m, self.device)
        self.tokenizer = load_tokenizer(m) if tokenizer is None else tokenizer
        self.reward_funcs = setup_rewards(cfg.rewards, self.device, t.per_device_train_batch_size, funcs=reward_funcs,
                                          processing_classes=reward_processing_classes, base_dir=recipe_dir)
        self.policy = setup_model(m, g, self.tokenizer, t.seed, model)
        self.eos_ids, self.pad_id = special_ids(m, self.tokenizer, self.policy)
        data = setup_data(cfg.data, t, g.max_prompt_length, self.plan, self.tokenizer,
                          self.policy.get_output_embeddings().weight.shape[0], train_rows=train_data,
                          eval_rows=eval_data, recipe_dir=self.recipe_dir)
        self.train_set, self.eval_set, self.sampler = data.train, data.eval, data.sampler
        t.max_steps = data.max_steps  # what the schedule, the loop and TrainerState read
        self.step = 0  # optimizer steps done (also what an evaluation-only trainer reports)
        self.num_input_tokens_seen = 0  # prompt + completion tokens generated so far (TRL's num_tokens)
        if not training:
            self.policy.to(self.device)
            self.rollout = self._rollout_context()
            return
        self.ref = setup_reference(t, self.policy, self.device, self.world)  # the model as loaded
        # train.layer_major_backward: the step recomputes the layers itself, so the model does not checkpoint
        self.layer_major = layer_major_wanted(cfg, self.world.size)
        group = layers_per_checkpoint(cfg, self.world.size)  # (both checked before the model is moved)
        hold_head = head_gradient_once(cfg, self.world.size)
        streamed = offload_weights(cfg, self.world.size)
        self.head, self.pack = setup_training_model(m, t, g, self.policy, self.device, resume,
                                                    checkpoint_layers=m.gradient_checkpointing and not self.layer_major,
                                                    offload_weights=streamed)
        self.loss_module, self.shards = setup_loss(cfg, self.policy, self.head, self.pack, self.autocast, self.world)
        self.optimizer, self.scheduler = setup_optimizer(
            cfg.optim, self.shards.module if self.shards else self.policy, t.max_steps,
            stochastic_rounding=m.precision == "bf16_sr", in_backward=t.optimizer_in_backward)
        # model.offload_weights: the layers' weights are the optimizer's host copies, streamed per layer
        streamer = (stream_trained_layers(self.optimizer, decoder_layers(self.head.decoder).layers, self.device)
                    if streamed else None)
        table = host_table(self.policy) if streamed else None  # and an untied embedding's table, looked up there
        if table is not None:
            look_up_on_host(self.optimizer, table)
        # How backwards become an update in this memory mode (step_modes.py)
        self.step_mode = make_step_mode(self.optimizer, self.policy, self.loss_module, self.shards,
                                        cfg.optim.max_grad_norm, head=self.head, layer_major=self.layer_major,
                                        autocast=self.autocast, offload_inputs=m.offload_activations, group=group,
                                        hold_head=hold_head, streamer=streamer)
        # model.torch_compile: the layers compiled for the training passes (None when off)
        self.compiled = compiled_layers(m, self.head.decoder, self.world.size)
        self.generation: Optional[GenerationBatch] = None
        self.nonfinite_in_a_row = 0
        self.last_saved_step = 0  # step 0 is the model as loaded: nothing to save yet
        self.resumed_from: Optional[Path] = None
        if self.world.rank:  # every rank built the same model; now each samples its own completions
            seed_everything(t.seed + self.world.rank)
        if resume is not None:
            self._resume(resume)
        self.stop = StopRequest()  # set by Ctrl-C/SIGTERM (or a caller): stop after the current step
        self.rollout = self._rollout_context(head=self.head, reference=self.ref, pack=self.pack,
                                             engine=self._vllm_engine(), compact=self._compact_policy(),
                                             streamer=streamer)
        self.compact_step = self.step  # the step whose weights the compact copy holds
        self.engine_closed = False  # close_engine() stopped vLLM: the next rollout starts it again

    def _rollout_context(self, **training_parts) -> RolloutContext:
        """What rollouts and evaluations use (context.py); the training-only parts: head, reference, pack."""
        return RolloutContext(self.policy, self.tokenizer, self.reward_funcs, self.eos_ids, self.pad_id, self.device,
                              self.autocast, world=self.world, **training_parts)

    def open_engine(self):
        """generation.engine=vllm: the engine, started again on the current weights where close_engine()
        closed it; None with the native engine."""
        if self.engine_closed:
            self.step_mode.synchronize()  # it starts from the weights as they are saved now
            self.rollout, self.engine_closed = replace(self.rollout, engine=self._vllm_engine()), False
        return self.rollout.engine

    def close_engine(self) -> None:
        """Stop the vLLM engine and free what it holds (its share of the card, its process group, its weights
        folder); train() calls it when it ends, normally or not. The next rollout starts another."""
        if self.rollout.engine is not None:
            engine, self.rollout = self.rollout.engine, replace(self.rollout, engine=None)
            self.engine_closed = True
            engine.close()

    def _vllm_engine(self):
        """generation.engine=vllm: vLLM in this process on a copy of the policy's weights (policy/vllm_engine.py)."""
        if rollout_engine(self.cfg.generation) != "vllm":
            return None
        if self.world.distributed:
            raise ConfigError("generation.engine=vllm runs in one process; under torchrun use generation.engine=native")
        from ..policy.vllm_engine import engine_for_run
        return engine_for_run(self.cfg, self.policy, self.device, self.autocast)

    def _compact_policy(self):
        """generation.rollout_quantization: the compact copy the native engine samples from (policy/compact.py)."""
        quantization = self.cfg.generation.rollout_quantization
        if quantization == "none":
            return None
        if self.world.distributed:
            raise ConfigError(f"generation.rollout_quantization={quantization} runs in one process; under torchrun "
                              "set it to none")
        from ..policy.compact import CompactPolicy
        return CompactPolicy(self.policy, quantization, device=self.device,
                             layers_on_host=self.cfg.model.offload_weights)

    # ----- resume and save -----------------------------------------------------------------------
    def _resume(self, path: Path) -> None:
        """Continue from checkpoint `path` (its weights are already loaded)."""
        state = ckpt.load_state(path)
        written_by = int(state.get("world_size", 1))
        if written_by != self.world.size:
            raise ConfigError(f"{path} was written by {written_by} process(es) and this run has {self.world.size}: "
                              f"resume with the same number (torchrun --nproc-per-node {written_by}). Each rank's "
                              "unfinished generation batch and RNG stream are in the checkpoint; another number "
                              "would change which completions each rank trains on. To go on with a different "
                              f"number, start a new run from its weights: model.name_or_path={path}")
        if self.world.rank:  # rank r's own generation batch and RNG (None: saved by a failing rank alone)
            mine = (state.get("other_ranks") or [None] * self.world.size)[self.world.rank - 1]
            state["generation"], state["rng"] = (mine["generation"], mine["rng"]) if mine else (None, None)
        self.optimizer.load_state_dict(ckpt.load_rank_file(path, f"optimizer-rank{self.world.rank}.pt")
                                       if self.world.fsdp else state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self.step = state["step"]
        self.nonfinite_in_a_row = state["nonfinite_in_a_row"]
        self.num_input_tokens_seen = int(state.get("num_input_tokens_seen", 0))  # absent from older checkpoints
        self.generation = GenerationBatch.from_state(state["generation"]) if state["generation"] else None
        if state["rng"] is not None:
            ckpt.set_rng_state(state["rng"])
        self.last_saved_step = self.step
        self.resumed_from = path
        logger.info(f"resumed from {path} at step {self.step}")

    def save(self, alone: bool = False) -> Path:
        """Write checkpoint-<step>. Under torchrun every rank calls it: rank 0 writes, with each rank's
        unfinished generation batch and RNG state. `alone`: a rank saves by itself, without collectives
        (the error path, when the other ranks may be gone); the checkpoint then has no generation batch,
        so a resumed run starts a new one on every rank."""
        self.step_mode.synchronize()  # the weights, states and RNG state of the last step, all landed
        mine = {"rng": ckpt.rng_state(),
                "generation": ckpt.plain(self.generation.state_dict()) if self.generation and not alone else None}
        if alone:  # the other ranks' entries stay None: on resume they start new batches with their own RNG
            ranks = [mine if r == self.world.rank else None for r in range(self.world.size)]
        else:
            ranks = self.world.gather_objects(mine)
        first = ranks[0] or {"rng": None, "generation": None}
        state = {
            "step": self.step, "scheduler": self.scheduler.state_dict(),
            "optimizer": None if self.world.fsdp else self.optimizer.state_dict(),  # FSDP2: a file per rank
            "sampler": self.sampler.state_dict(), "rng": first["rng"], "generation": first["generation"],
            "nonfinite_in_a_row": self.nonfinite_in_a_row, "num_input_tokens_seen": self.num_input_tokens_seen,
        }
        if self.world.distributed:
            state.update(world_size=self.world.size, other_ranks=ranks[1:])
        path, tmp, weights, out = None, None, None, self.cfg.output
        if self.world.fsdp:  # each rank writes its optimizer shard into rank 0's folder; weights gathered whole
            tmp = Path(self.world.gather_objects(str(ckpt.new_tmp_folder(out.output_dir, self.step))
                                                 if self.world.is_main else None)[0])
            ckpt.save_rank_file(tmp, f"optimizer-rank{self.world.rank}.pt", self.optimizer.state_dict())
            weights = self.full_state_dict()
            self.world.barrier()
        if self.world.is_main or alone:
            path = ckpt.save_checkpoint(out.output_dir, self.step, self.policy, self.tokenizer, state,
                                        out.save_total_limit, self.cfg.to_dict(), tmp=tmp, weights=weights)
        if not alone:  # the other ranks wait for the checkpoint to be on disk
            path = Path(self.world.gather_objects(str(path) if path else None)[0])
        self.last_saved_step = self.step
        notify(self.callbacks, "on_save", self, self.step, path)
        return path

    def full_state_dict(self) -> dict:
        """The policy's weights as whole CPU tensors (under FSDP2 gathered from every rank: a collective,
        every rank calls it; only rank 0 gets them, the others an empty dict)."""
        return distributed.full_state_dict(self.policy, self.loss_module, self.world)

    def _unsaved_work_to_save(self) -> bool:
        """On an error: whether this process saves. Under torchrun not when another rank failed first
        (a collective failed, or torchrun's agent sent SIGTERM to stop this one): that rank saves."""
        if self.step <= self.last_saved_step:
            return False
        return not (self.world.distributed and (distributed.peer_failed(sys.exc_info()[1])
                                                or self.stop.reason == "SIGTERM"))

    def _save_on_error(self) -> Path:
        """save_on_error's save: with one process the normal save; under torchrun this rank saves alone
        (DDP: every rank holds the same weights and optimizer states), since the others may not answer."""
        if not self.world.distributed:
            return self.save()
        if isinstance(sys.exc_info()[1], KeyboardInterrupt) and not self.world.is_main:
            raise ckpt.CheckpointError("interrupted on every rank: rank 0 saves")  # one writer, not N
        if self.world.fsdp:
            raise ckpt.CheckpointError("under strategy=fsdp a rank holds 1/N of the weights and cannot save "
                                       "alone; the last checkpoint holds the run")
        # Leave the process group first: this rank is stopping anyway, its peers' pending collectives end
        # (they see a PeerFailure and do not save), and transformers' save_pretrained writes on rank 0 of
        # an initialized group only.
        distributed.stop()
        return self.save(alone=True)

    def add_callback(self, callback) -> None:
        """Add a TrainerCallback (instance or class) after construction; see training/callbacks.py."""
        self.callbacks.append(as_callback(callback))

    # ----- rollout -----------------------------------------------------------------------------
    def new_generation_batch(self) -> GenerationBatch:
        drawn = self.sampler.state_dict()  # epochs of prompts drawn so far: TrainerState.epoch, as TRL's
        state = make_trainer_state(self.cfg, self.plan, global_step=self.step,
                                   epoch=drawn["epoch"] + drawn["position"] / drawn["num_prompts"],
                                   num_input_tokens_seen=self.num_input_tokens_seen)
        # Every rank draws the same global prompts and keeps its slice: whole groups stay on one rank.
        drawn = self.sampler.next_indices(self.plan.prompts_per_generation)
        n, r = self.plan.prompts_per_rank, self.world.rank
        prompts = self.train_set.select(drawn[r * n:(r + 1) * n])
        engine = self.open_engine()
        if engine is not None and engine.synced_step != self.step:  # vLLM samples with the weights being trained
            # vLLM reads the weights outside a forward: wait for the last update (offload: the update thread;
            # CUDA: vLLM copies on this thread's stream, now after the uploads) and its RNG (vLLM's seed draws).
            self.step_mode.synchronize()
            engine.sync(self.policy, self.step)
        self._refresh_compact()
        with distributed.full_weights(self.loss_module, self.world):  # FSDP2: rollout and log-probs need them whole
            gb = make_generation_batch(self.cfg, self.plan, prompts, self.rollout, epoch=self.sampler.epoch,
                                       trainer_state=state)
        self.num_input_tokens_seen = state.num_input_tokens_seen
        return gb

    # ----- one optimizer step ------------------------------------------------------------------
    def micro_batch_loss(self, mb: Batch, num_items: int, scale: float = 1.0, tokens: Optional[int] = None):
        """Loss of one micro-batch (already on the device) through the fused head, and its metrics
        (training/loss.py). `scale` restores the loss denominators of rows left out (skipped
        zero-advantage completions); `num_items` is dapo's denominator over every rank; `tokens`, the
        micro-batch's completion tokens counted on the host, spares the head a device sync."""
        return self.loss_module(mb, num_items, scale, tokens=tokens)

    def optimizer_step(self) -> dict:
        """One optimizer step on the next micro-batches of the current generation batch: each micro-batch's
        loss and backward, then the update, as the step mode makes them (step_modes.py: .grad and
        optimizer.step(), the optimizer inside backward, or the host's update); the step's metrics
        (reported names: metrics.py)."""
        t, gb, world, mode = self.cfg.train, self.generation, self.world, self.step_mode
        rows = gb.next_micro_batches(self.plan, t.per_device_train_batch_size, t.gradient_accumulation_steps)
        num_items = int(world.sum([step_completion_tokens(rows)])[0])  # every rank's completion tokens
        self.policy.train()
        works = [plan_micro_batch(mb, t, world.distributed) for mb in rows]  # which rows learn, their loss scale
        losses = [None if w.rows is None else functools.partial(
            self.micro_batch_loss, w.rows.to(self.device), num_items, scale=w.scale, tokens=w.tokens) for w in works]
        tally = StepTally()  # the sums stay on the device: one host read per step
        if self.compiled:  # compiled layers skip the offload mode's per-module waits: every update lands first
            mode.synchronize()
        with self.compiled.active() if self.compiled else contextlib.nullcontext():
            with phase("forward"):
                mode.begin([loss_fn for loss_fn in losses if loss_fn is not None])
            for i, (work, loss_fn) in enumerate(zip(works, losses)):
                if loss_fn is None:
                    if work.skipped:  # every completion skipped: no backward, a zero gradient
                        mode.skipped_micro_batch()
                    continue
                with mode.micro_batch(last=i == len(rows) - 1):
                    with phase("forward"):
                        loss, metrics = mode.forward(loss_fn)
                        tally.add(loss, metrics, work.tokens if work.learns else None)
                    with phase("backward"):
                        mode.backward(loss, tally.loss_is_finite)  # loss.backward(), the optimizer in it or not
                if work.learns:
                    tally.count(computed_tokens(work.rows, self.pack, self.head.decoder), work.tokens)
            totals = self._summed_over_ranks(tally.totals())
            # clip, optimizer.step(); the layer-major mode's backward of the layers runs here
            grad_norm, finite = mode.finish(totals.loss, num_items, totals.backwards)
        lr = self._after_update(finite)
        gb.steps_done += 1
        out = trl_names(step_means(totals.sums, num_items=num_items, computed=totals.computed,
                                   backwards=totals.backwards))
        out.update(loss=totals.loss, grad_norm=grad_norm, learning_rate=lr,
                   skipped=int(not finite or not num_items), train_tokens=totals.tokens)
        out.update(TRANSFERS.take())  # this step's bytes host<->device (its generation batch's too: run_step)
        return out

    def _summed_over_ranks(self, totals: StepTotals) -> StepTotals:
        """Token-weighted sums and counts over ranks; the loss is the ranks' mean (loss.py). Every rank
        ran every micro-batch, so every rank has the same metric names."""
        world = self.world
        if not world.distributed:
            return totals
        names = sorted(totals.sums)
        total = world.sum([totals.loss, totals.tokens, totals.computed, totals.backwards]
                          + [totals.sums[k] for k in names])
        return StepTotals(total[0] / world.size, dict(zip(names, total[4:])), int(total[1]), int(total[2]),
                          int(total[3]))

    def _after_update(self, finite: bool) -> float:
        """Clear the gradients, advance the schedule and count non-finite steps; the step's learning rate."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.shards:
            self.policy.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        with warnings.catch_warnings():  # a skipped step still advances the schedule; torch would warn
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step()
        self.nonfinite_in_a_row = 0 if finite else self.nonfinite_in_a_row + 1
        return lr

    def run_step(self) -> tuple[GenerationBatch, dict, float]:
        """One optimizer step, generating a new batch first when the current one is used up.

        Returns the generation batch the step used, the step's metrics and the generation time (0 when
        the batch was already there)."""
        generation_time = 0.0
        TRANSFERS.take()  # the step's transfer counts are its own (not set-up's, an evaluation's, another trainer's)
        if self.generation is None:
            self.generation = self.new_generation_batch()
            generation_time = self.generation.generation_time
        gb = self.generation
        step_metrics = self.optimizer_step()
        self.step += 1
        if gb.steps_done >= self.plan.steps_per_generation_batch:
            self.generation = None
        return gb, step_metrics, generation_time

    # ----- the loop ----------------------------------------------------------------------------
    def train(self) -> dict:
        """Train to max_steps (or a stop), saving on the way; evaluations and the run's plot as configured.
        output_dir stays locked to this run, and a vLLM engine open, only while it runs."""
        eval_steps = self.cfg.eval.eval_steps
        if eval_steps and self.eval_set is None:
            raise ConfigError(f"eval_steps={eval_steps} needs held-out prompts: "
                              "set data.eval_file or data.eval_holdout")
        if self.output_lock is not None:
            self.output_lock.acquire(running=True)  # held again by a later train() of this trainer
        try:
            return self._train()
        finally:
            self.close_engine()  # vLLM's memory, graphs and process group do not outlive the run
            if self.output_lock is not None:
                self.output_lock.release()

    def _train(self) -> dict:
        cfg, out = self.cfg, self.cfg.output
        eval_steps = cfg.eval.eval_steps
        main = self.world.is_main  # under torchrun only rank 0 writes files, logs and evaluates
        log = (RunLog(out.output_dir, out.report_to, resume_step=self.step if self.resumed_from else None,
                      run_name=out.run_name, project=out.project, config=cfg.to_dict()) if main else NullLog())
        if main:
            Path(out.output_dir, "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        before = (self._evaluation_outside_the_loop(evaluation_before, out.output_dir, self.resumed_from is not None)
                  if cfg.eval.eval_on_start else None)
        bar = tqdm(total=cfg.train.max_steps, initial=self.step, disable=not (out.progress_bar and main), desc="grpo")
        last = {}
        try:
            with self.stop.on_signals(), save_on_error(self._save_on_error, self._unsaved_work_to_save):
                if (eval_steps and self.resumed_from and self.step and self.step % eval_steps == 0
                        and self.step not in evaluated_steps(Path(out.output_dir, "metrics.jsonl"))):
                    # stopped or crashed before it ran
                    self._on_main(evaluation_during, self.evaluate, self.policy, log, self.step)
                stopping = False  # agreed by every rank after each step (a signal reaches ranks at different times)
                while self.step < cfg.train.max_steps and not stopping:
                    last = self._logged_step(log)
                    stopping = self.world.any(self.stop.reason is not None)
                    if stopping and self.stop.reason is None:
                        self.stop.request("a stop request on another rank")
                    bar.update(1)
                    bar.set_postfix(reward=f"{last['reward']:.3f}", kl=f"{last.get('kl', 0.0):.4f}",
                                    step_time=f"{last['step_time']:.1f}s")
                    if self.nonfinite_in_a_row >= cfg.train.max_nonfinite_steps:
                        path = self.save()
                        raise TrainingStopped(f"{self.nonfinite_in_a_row} optimizer steps in a row had a non-finite "
                                              f"loss or gradient; stopped and saved {path}. Lower "
                                              "optim.learning_rate or check the reward scale.")
                    # Before the save: a run killed between the two repeats the step and its evaluation.
                    if eval_steps and self.step % eval_steps == 0 and not stopping:
                        self._on_main(evaluation_during, self.evaluate, self.policy, log, self.step)
                    if out.save_steps and self.step % out.save_steps == 0:
                        self.save()
                self.step_mode.synchronize()  # the caller gets the trained weights (offload: updated on a thread)
                if self.step > self.last_saved_step:
                    logger.info(f"saved {self.save()}")
        except torch.OutOfMemoryError as e:  # saved by save_on_error; say where and what to change
            if main:
                save_run_plot(out.output_dir)
            raise self._explained(e) from e
        except BaseException:
            if main:
                save_run_plot(out.output_dir)  # a crash or a stop on non-finite steps still leaves a picture
            raise
        finally:
            bar.close()
            log.close()
        if self.stop.reason is not None:
            logger.info(f"stopped by {self.stop.reason} at step {self.step}")
        result = {"step": self.step, "last": last, "stopped_by": self.stop.reason}
        if cfg.eval.eval_on_end and not self.world.any(self.stop.reason is not None):
            result["eval_end"] = self._evaluation_outside_the_loop(evaluation_after, out.output_dir, before, self.step)
        if main:
            save_run_plot(out.output_dir)
        return result

    def _explained(self, error: torch.OutOfMemoryError) -> RunOutOfMemory:
        """The error that names the phase, the cheapest fix and the last checkpoint (saved before this)."""
        if isinstance(error, RunOutOfMemory):
            return error
        saved = ckpt.list_checkpoints(self.cfg.output.output_dir)
        return RunOutOfMemory(out_of_memory_message(error, self.cfg, self.step, str(saved[-1][1]) if saved else None))

    def _evaluation_outside_the_loop(self, when, *args):
        """The evaluation before the first step or after the last: outside the loop's save-on-error (nothing
        unsaved), but an out-of-memory error is explained as one inside it is."""
        try:
            return self._on_main(when, self.evaluate, *args)
        except torch.OutOfMemoryError as e:
            raise self._explained(e) from e

    def _on_main(self, fn, *args):
        """fn(*args) on rank 0 only (evaluations), None elsewhere. The other ranks go on to their next
        collective, which waits for rank 0; under FSDP2 every rank first gathers the full weights."""
        with distributed.full_weights(self.loss_module, self.world):
            return fn(*args) if self.world.is_main else None

    def _logged_step(self, log: RunLog) -> dict:
        """run_step() with its timing and peak memory, written to the logs every logging_steps."""
        reset_peak_memory(self.device)
        t0 = time.perf_counter()
        gb, step_metrics, generation_time = self.run_step()
        step_time = time.perf_counter() - t0
        metrics = {**gb.info, **step_metrics, "step_time": step_time, "generation_time": generation_time,
                   "tokens_per_second": step_metrics.pop("train_tokens") / step_time,
                   "peak_memory_bytes": peak_memory_bytes(self.device)}
        metrics.pop("train_tokens", None)
        notify(self.callbacks, "on_step_end", self, self.step, metrics)
        out = self.cfg.output
        if self.step % out.logging_steps == 0 or self.step == self.cfg.train.max_steps:
            log.metrics(self.step, metrics)
            if gb.samples:  # each generation batch's samples are written once
                log.completions(self.step, gb.samples)
                gb.samples = []
            notify(self.callbacks, "on_log", self, self.step, metrics)
        return metrics

    def _refresh_compact(self) -> None:
        """The compact copy quantized from the weights being trained, if it is older than them."""
        compact = self.rollout.compact
        if compact is not None and (self.compact_step != self.step or compact.released):
            self.step_mode.synchronize()  # (their last update landed)
            compact.refresh()
            self.compact_step = self.step

    def evaluate(self) -> dict:
        """Greedy completions of the held-out prompts, scored. Under model.offload_weights by the compact copy
        (the rollouts' sampler): the policy's own weights are never all on the device at once."""
        if self.eval_set is None:
            raise ConfigError("no held-out prompts: set data.eval_file or data.eval_holdout")
        e = self.cfg.eval
        ctx = self.rollout
        if ctx.streamer is not None:
            self._refresh_compact()
            ctx = replace(ctx, policy=ctx.compact.model)
        try:
            with phase("evaluation"):
                return evaluate(ctx, self.eval_set, self.cfg.generation, batch_size=e.eval_batch_size,
                                max_samples=e.eval_max_samples,
                                output_file=Path(self.cfg.output.output_dir, "eval_completions.jsonl"),
                                trainer_state=make_trainer_state(self.cfg, self.plan, global_step=self.step,
                                                                 epoch=self.sampler.epoch,
                                                                 num_input_tokens_seen=self.num_input_tokens_seen))
        finally:
            if ctx.streamer is not None:  # (made again before the next rollout)
                ctx.compact.release()
