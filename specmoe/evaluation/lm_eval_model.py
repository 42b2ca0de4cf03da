"""An lm-evaluation-harness (0.4.x) model, registered as ``specmoe``: a transformers MoE model routed by a
routing policy, or decoded speculatively with a block-level selector, in specmoe's harness.

What it runs (batch 1, one request at a time, greedy):
- a routing policy (default): the model is patched with `specmoe.harness.patch_model`; each request's first
  forward has no past positions, so its logical cache starts from the warm set with zero statistics (the
  paper's per-request reset). `loglikelihood` scores context + continuation teacher-forced in one forward
  (routing runs position by position inside it, as in token-by-token decoding); `loglikelihood_rolling`
  scores lm-eval's disjoint windows the same way, each window a request of its own; `generate_until`
  prefills the context without its last token, then feeds one token per step (as
  `specmoe.harness.greedy_decode` does) until a stop string, the eos token or max_gen_toks.
- speculative decoding (``selector=exact|acceptmoe|confidence_top1``): `generate_until` runs
  `specmoe.harness.speculative_generate` with the drafter, k drafts per block and a pool of P experts per
  layer, stopping after the first new token or the block in which a stop string appears (or at eos or
  max_gen_toks), then cuts the text at the first stop string. Loglikelihood requests are refused:
  speculative decoding defines generated text, not a teacher-forced score.

Model arguments (``--model_args`` / ``model_args=``): ``pretrained`` (checkpoint directory or named config;
default the shipped family's target; from Python also a model loaded by `specmoe.models.load_model`, which
the policy then patches: one `SpecmoeLM` per model at a time), ``tokenizer`` (directory; default
``pretrained``), ``policy`` (a preset of `specmoe.routing.PRESETS`, default exact_lru), ``capacity`` (C;
default E, all experts resident; needed by every other policy), any policy field as an override
(``bonus=0.25``, ``window=4``, ...), ``calibration`` (a calibration file; default: `calibration_windows` x
`calibration_length` tokens sampled from the model under exact routing, seed + 1, as `specmoe sd` does),
``selector`` (instead of a policy), ``drafter`` (ar, dflash, synthetic), ``drafter_path``, ``k``, ``pool``,
``synthetic_acceptance``, ``max_length``, ``max_gen_toks`` (default 256), ``add_bos_token``, ``dtype``
(float32), ``device`` (cpu), ``seed``, ``threads``.

Run it with lm-eval's command line through `python3 -m specmoe.evaluation`, which registers the model first:

    python3 -m specmoe.evaluation run --model specmoe \\
        --model_args policy=psr capacity=32 bonus=0.3 calibration=cal.safetensors --tasks gsm8k \\
        --log_samples --output_path runs/lm_eval/psr

or from Python: ``import specmoe.evaluation.lm_eval_model`` then ``lm_eval.simple_evaluate(model="specmoe",
...)``, or pass a `SpecmoeLM` instance as the model.
"""

from __future__ import annotations

import logging
import time

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("specmoe.evaluation.lm_eval_model needs lm-evaluation-harness 0.4: install the `eval` extra "
                      "(pip install 'specmoe[eval]')") from exc

import torch

MODEL_NAME = "specmoe"


@register_model(MODEL_NAME)
class SpecmoeLM(TemplateLM):
    """lm-eval's view of a model in specmoe's harness (see the module docstring for the arguments)."""

    def __init__(self, pretrained: str | None = None, tokenizer: str | None = None, policy: str = "exact_lru",
                 capacity: int | None = None, calibration: str | None = None, selector: str | None = None,
                 drafter: str = "ar", drafter_path: str | None = None, k: int = 8, pool: int = 32,
                 synthetic_acceptance: float = 0.8, max_length: int | None = None, max_gen_toks: int = 256,
                 add_bos_token: bool = False, dtype: str = "float32", device: str | None = None, seed: int = 0,
                 threads: int | None = None, calibration_windows: int = 16, calibration_length: int = 128,
                 batch_size: int | str | None = 1, max_batch_size: int | None = None, **policy_fields):
        super().__init__()
        from transformers import AutoTokenizer

        from specmoe.models import default_model, load_model
        from specmoe.routing import parse_policy

        if str(batch_size) not in ("1", "None"):
            raise ValueError(f"the specmoe model runs batch 1 (one logical cache per request), "
                             f"got batch_size={batch_size}")
        if int(max_gen_toks) < 1:
            raise ValueError(f"max_gen_toks must be >= 1, got {max_gen_toks}")
        if threads:
            torch.set_num_threads(int(threads))
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            logging.getLogger(__name__).warning("device %s is not available (lm-eval's default): using cpu", device)
            device = "cpu"
        if isinstance(pretrained, torch.nn.Module):  # a model loaded by `specmoe.models.load_model`
            from specmoe.models import adapter_for

            self.model, self.adapter = pretrained, adapter_for(pretrained.config)
            source = str(getattr(pretrained, "specmoe_source", "the given model"))
        else:
            source = str(pretrained or default_model())
            self.model, self.adapter = load_model(source, seed=int(seed), dtype=dtype, device=device or "cpu")
        self._device = next(self.model.parameters()).device
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer or source), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"no tokenizer for {source}: pass tokenizer=DIR ({exc})") from None
        self.add_bos_token = bool(add_bos_token)
        self._max_length = int(max_length or getattr(self.model.config, "max_position_embeddings", 2048))
        self.max_gen_toks = int(max_gen_toks)
        eos = self.model.config.eos_token_id
        self._eot = eos if isinstance(eos, int) else self.tokenizer.eos_token_id
        if not isinstance(self._eot, int):
            raise ValueError(f"{source}: neither the config nor the tokenizer names an eos token")

        adapter = self.adapter
        if selector is not None and (policy != "exact_lru" or capacity is not None or policy_fields):
            raise ValueError("selector= (speculative decoding, with its pool of pool= experts) and a routing policy "
                             "(policy=, capacity=, policy fields) are alternatives: give one")
        if capacity is None and policy not in ("exact_lru", "exact_a"):
            raise ValueError(f"policy {policy} needs capacity=C (expert slots per layer)")
        overrides = [f"{key}={value}" for key, value in policy_fields.items()]
        self.policy = parse_policy(policy, int(capacity or adapter.num_experts), adapter.top_k, overrides)
        self.calibration = self._calibration(calibration, int(calibration_windows), int(calibration_length),
                                             int(seed))
        self.speculative = None
        if selector is not None:
            self.speculative = self._speculative_setup(selector, drafter, drafter_path, int(k), int(pool),
                                                       float(synthetic_acceptance), int(seed))
        self.context = None
        if self.speculative is None:
            from specmoe.harness import patch_model

            self.context = patch_model(self.model, adapter, self.policy, self.calibration)
        self.counts: list = []  # speculative requests' counts (SpeculativeResult.counts)
        self.seconds = 0.0

    # -- set-up -----------------------------------------------------------------------------------------------
    def _calibration(self, path: str | None, windows: int, length: int, seed: int):
        """The calibration file at `path`, or one collected on windows sampled from the model (module doc)."""
        from specmoe.harness import collect_calibration, sample_selfgen
        from specmoe.routing import Calibration

        if path is not None:
            return Calibration.load(path)
        held_out = sample_selfgen(self.model, windows, length, seed=seed + 1)
        return collect_calibration(self.model, self.adapter, held_out.windows, {
            "text": f"{windows} windows of {length} tokens sampled from the exact model, seed {seed + 1}"})

    def _speculative_setup(self, selector: str, drafter: str, drafter_path, k: int, pool: int, acceptance: float,
                           seed: int):
        """(drafter, SpeculativeConfig) of the speculative mode; checks that they fit the model."""
        from specmoe.drafters import DrafterConfig, build_drafter
        from specmoe.harness import check_calibration
        from specmoe.speculation import SpeculativeConfig
        from specmoe.verifiers import selector_preset

        config = SpeculativeConfig(selector_preset(selector), k=k, pool_size=pool, max_new_tokens=self.max_gen_toks,
                                   stop_tokens=(self._eot,))
        built = build_drafter(DrafterConfig(drafter, path=drafter_path, acceptance=acceptance, seed=seed), self.model)
        config.check(self.adapter, built)
        check_calibration(self.model, self.adapter, self.calibration)
        return built, config

    # -- what lm-eval asks of a model --------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        ids = self.tokenizer.encode(string, add_special_tokens=False)
        if (self.add_bos_token if add_special_tokens is None else add_special_tokens) and self.tokenizer.bos_token_id \
                is not None and ids[:1] != [self.tokenizer.bos_token_id]:
            ids = [self.tokenizer.bos_token_id] + ids
        return ids

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: run without --apply_chat_template")
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether greedy decoding gives the continuation) per request, each
        scored teacher-forced in one forward that starts a new sequence (logical state reset)."""
        self._refuse_speculative("loglikelihood")
        results = []
        for request, context_enc, continuation_enc in requests:
            if not 0 < len(continuation_enc) <= self.max_length:
                raise ValueError(f"a continuation of {len(continuation_enc)} tokens: need 1 to max_length="
                                 f"{self.max_length}")
            tokens = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1):]
            n = len(continuation_enc)
            started = time.perf_counter()
            logits = self.model(input_ids=torch.tensor([tokens[:-1]], device=self._device), use_cache=False).logits
            logprobs = torch.log_softmax(logits[0, -n:].float(), dim=-1)
            self.seconds += time.perf_counter() - started
            target = torch.tensor(continuation_enc, device=logprobs.device)
            answer = (float(logprobs.gather(-1, target[:, None]).sum()), bool((logprobs.argmax(-1) == target).all()))
            results.append(answer)
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole string: lm-eval's disjoint windows of at most max_length tokens,
        each window scored as its own request (its own logical state), summed."""
        self._refuse_speculative("loglikelihood_rolling")
        results = []
        for (string,) in [request.args for request in requests]:
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1))
            total = sum(ll for ll, _ in self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows]))
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context, cut at the first of its stop strings."""
        results = []
        for context, gen_kwargs in [request.args for request in requests]:
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError("the specmoe model decodes greedily: the task asks for sampling (do_sample=True)")
            until = [s for s in handle_stop_sequences(kwargs.get("until"), None) if s]
            max_new = int(kwargs["max_gen_toks"])
            if not 0 < max_new < self.max_length:
                raise ValueError(f"max_gen_toks={max_new} must be in [1, max_length={self.max_length})")
            prompt = self.tok_encode(context)[-(self.max_length - max_new):] or [self.prefix_token_id]
            started = time.perf_counter()
            new = self._speculative_decode(prompt, max_new, until) if self.speculative else \
                self._greedy_decode(prompt, max_new, until)
            self.seconds += time.perf_counter() - started
            text = postprocess_generated_text(self.tok_decode(new), until, None)
            results.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return results

    # -- decoding ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _greedy_decode(self, prompt: list[int], max_new: int, until: list[str]) -> list[int]:
        """Greedy decoding under the routing policy with `greedy_decode`'s prefill convention (the prompt
        without its last token in one forward, then one token per step), until a stop string appears in the
        decoded new text, the eos token or max_new tokens."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if len(prompt) > 1:
            self.model(input_ids=torch.tensor([prompt[:-1]], device=self._device), past_key_values=cache,
                       use_cache=True)
        new: list[int] = []
        while len(new) < max_new:
            ids = torch.tensor([[new[-1] if new else prompt[-1]]], device=self._device)
            new.append(int(self.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].argmax()))
            if new[-1] == self._eot or (until and any(s in self.tok_decode(new) for s in until)):
                break
        return new

    def _speculative_decode(self, prompt: list[int], max_new: int, until: list[str] = ()) -> list[int]:
        """The harness's speculative loop on one request (its own pool and commitment rates)."""
        import dataclasses

        from specmoe.harness import speculative_generate

        drafter, config = self.speculative
        if config.max_new_tokens != max_new:
            config = dataclasses.replace(config, max_new_tokens=max_new)
        stop = (lambda new: any(s in self.tok_decode(new) for s in until)) if until else None
        result = speculative_generate(self.model, self.adapter, drafter, prompt, config, calibration=self.calibration,
                                      divergence=False, stop=stop)
        self.counts.append(result.counts())
        return result.tokens.tolist()

    def _refuse_speculative(self, what: str) -> None:
        if self.speculative is not None:
            raise ValueError(f"{what} requests (multiple-choice and perplexity tasks) are scored teacher-forced; "
                             "speculative decoding (selector=...) defines generated text only: evaluate them with a "
                             "routing policy (no selector)")

    def routing_summary(self) -> dict:
        """What the evaluation cost in the harness so far: logical copies per routed token (routing policy)
        or the speculative loop's pooled figures (tau, copies per committed token, ...), and the seconds
        spent in the model."""
        if self.speculative is not None:
            from specmoe.speculation import summarize

            return {"seconds": self.seconds, **(summarize(self.counts) if self.counts else {})}
        from specmoe.harness import copy_stats

        self.context.finish()
        return {"seconds": self.seconds, **copy_stats(self.context)}

    def clear_summary(self) -> None:
        """Start `routing_summary`'s figures again from zero (`specmoe eval` reports each task's own)."""
        self.seconds, self.counts = 0.0, []
        if self.context is not None:
            self.context.finish()
            self.context.clear_counters()
