"""The engines ``bench peers`` runs on the same prompts (token-id lists), greedy, fixed output length.

Each engine has ``workload(prompts, output_len, concurrency) -> WorkloadRun`` and
``single_stream(prompt, decode_tokens) -> (prefill tok/s, decode tok/s)``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class WorkloadRun:
    engine: str
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def mean_ttft_s(self) -> float:
        return sum(self.ttft_s) / len(self.ttft_s) if self.ttft_s else float("nan")


class PolychipPeer:
    name = "polychip"

    def __init__(self, model_path: str | None, device: str = "cpu", **engine_args):
        from polychip.engine.llm import LLM
        if engine_args.get("quantization"):
            self.name = f"polychip {engine_args['quantization']}"
        # the stage profile it reports is exact on asynchronous devices too (a no-op on the cpu)
        self.llm = LLM(model_path, dtype="float32", device=device, profile_stages=True, **engine_args)
        self._warm()

    def _warm(self) -> None:
        from polychip.engine.sampling_params import SamplingParams
        self.llm.generate([[1] * 40, [2] * 40], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        self.llm.engine.stage_seconds.clear()

    def _params(self, n: int):
        from polychip.engine.sampling_params import SamplingParams
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def workload(self, prompts: list[list[int]], output_len: int, concurrency: int) -> WorkloadRun:
        eng = self.llm.engine
        eng.scheduler.max_running = concurrency
        eng.stage_seconds.clear()
        t = time.perf_counter()
        outs = self.llm.generate(prompts, self._params(output_len))
        wall = time.perf_counter() - t
        return WorkloadRun(self.name, wall, sum(map(len, prompts)), sum(len(o.outputs[0].token_ids) for o in outs),
                           [o.ttft for o in outs if o.ttft is not None])

    def single_stream(self, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
        out = self.llm.generate([prompt], self._params(decode_tokens + 1))[0]
        return len(prompt) / out.ttft, 1.0 / out.tpot

    def stage_seconds(self) -> dict[str, float]:
        return dict(self.llm.engine.stage_seconds)

    def close(self) -> None:
        self.llm.shutdown()


class _FirstTokenClock:
    """A transformers logits processor that notes when each generation step's logits arrive
    (after ``sync``: on an accelerator they arrive when the device finishes, not when queued)."""

    def __init__(self, sync):
        self.times: list[float] = []
        self.sync = sync

    def __call__(self, input_ids, scores):
        self.sync()
        self.times.append(time.perf_counter())
        return scores


class TransformersPeer:
    """``transformers`` generate: ``batched=False`` serves requests one by one (the naive server),
    ``batched=True`` runs static batches of ``concurrency`` prompts; on ``plugin``'s device."""

    def __init__(self, model_dir: str, batched: bool, plugin):
        from transformers import AutoModelForCausalLM
        self.batched = batched
        self.plugin = plugin
        self.name = "transformers static batch" if batched else "transformers one-by-one"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          local_files_only=True).eval()
        self.model.to(plugin.device_handle())
        self.pad = self.model.config.eos_token_id
        if isinstance(self.pad, list):
            self.pad = self.pad[0]
        self._generate([[1] * 8], 2)

    def _generate(self, prompts: list[list[int]], n: int) -> list[float]:
        from transformers import LogitsProcessorList
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])        # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        ids, mask = self.plugin.to_device(ids), self.plugin.to_device(mask)
        clock = _FirstTokenClock(self.plugin.synchronize)
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=self.pad, logits_processor=LogitsProcessorList([clock]))
        self.plugin.synchronize()
        return clock.times

    def workload(self, prompts: list[list[int]], output_len: int, concurrency: int) -> WorkloadRun:
        step = concurrency if self.batched else 1
        ttft, t0 = [], time.perf_counter()
        for i in range(0, len(prompts), step):
            group = prompts[i:i + step]
            times = self._generate(group, output_len)
            ttft += [times[0] - t0] * len(group)
        return WorkloadRun(self.name, time.perf_counter() - t0, sum(map(len, prompts)),
                           len(prompts) * output_len, ttft)

    def single_stream(self, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
        t = time.perf_counter()
        times = self._generate([prompt], decode_tokens + 1)
        return len(prompt) / (times[0] - t), decode_tokens / (times[-1] - times[0])

    def close(self) -> None:
        del self.model


class LlamaCppPeer:
    """llama.cpp (``llama-cpp-python``, the optional ``llamacpp`` extra) on the GGUF file: each prompt
    is prefilled in ``n_batch`` chunks, then all running sequences decode in one batch per step."""

    name = "llama.cpp"

    def __init__(self, gguf_path: str, max_seqs: int, max_len: int, threads: int):
        import llama_cpp
        self.lc = llama_cpp
        self.n_batch = 512
        self.max_seqs = max_seqs
        # the model through the high-level class; a context of our own, since that class fixes
        # one sequence per context and the workload needs ``max_seqs`` decoding together
        self.llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=64, n_threads=threads, verbose=False)
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = max_seqs * max_len, self.n_batch, self.n_batch
        # one KV stream per sequence: with a unified buffer, llama-cpp-python 0.3.36 attends every
        # sequence over all of it (masked), 1.4 s against 0.1 s per 16-sequence decode step here
        cp.n_seq_max, cp.n_threads, cp.n_threads_batch, cp.kv_unified = max_seqs, threads, threads, False
        self.ctx = llama_cpp.llama_init_from_model(self.llm._model.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = self.llm.n_vocab()
        self.batch = llama_cpp.llama_batch_init(max(self.n_batch, max_seqs), 0, max_seqs)

    def _clear(self) -> None:
        lc = self.lc
        if hasattr(lc, "llama_get_memory"):
            lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        else:
            lc.llama_kv_self_clear(self.ctx)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits)."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, row: int) -> int:
        import numpy as np
        ptr = self.lc.llama_get_logits_ith(self.ctx, row)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def _prefill(self, prompt: list[int], seq: int) -> int:
        for s in range(0, len(prompt), self.n_batch):
            chunk = prompt[s:s + self.n_batch]
            last = s + len(chunk) == len(prompt)
            self._decode([(t, s + j, seq, last and j == len(chunk) - 1) for j, t in enumerate(chunk)])
        return self._argmax(len(prompt) - 1 - (len(prompt) - 1) // self.n_batch * self.n_batch)

    def _run(self, prompts: list[list[int]], output_len: int, t0: float) -> tuple[list[float], list[float]]:
        """One wave: prefill each prompt, then decode all together. (ttfts, decode step end times)."""
        self._clear()
        last, ttft = [], []
        for seq, p in enumerate(prompts):
            last.append(self._prefill(p, seq))
            ttft.append(time.perf_counter() - t0)
        steps = []
        for k in range(output_len - 1):
            self._decode([(last[s], len(p) + k, s, True) for s, p in enumerate(prompts)])
            last = [self._argmax(i) for i in range(len(prompts))]
            steps.append(time.perf_counter())
        return ttft, steps

    def workload(self, prompts: list[list[int]], output_len: int, concurrency: int) -> WorkloadRun:
        ttft, t0 = [], time.perf_counter()
        for i in range(0, len(prompts), min(concurrency, self.max_seqs)):
            ttft += self._run(prompts[i:i + min(concurrency, self.max_seqs)], output_len, t0)[0]
        return WorkloadRun(self.name, time.perf_counter() - t0, sum(map(len, prompts)),
                           len(prompts) * output_len, ttft)

    def single_stream(self, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        ttft, steps = self._run([prompt], decode_tokens + 1, t0)
        return len(prompt) / ttft[0], decode_tokens / (steps[-1] - t0 - ttft[0])

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.llm.close()
