"""Beam search, driven above the engine: each step every live beam is a one-token request.

Why above the engine: a beam step is an ordinary request (prompt + the beam's tokens,
``max_tokens=1``, top-2k logprobs), so beam search runs unchanged in every layout and
through migration, and the prefix cache does the sharing: the prompt's full KV blocks
(images included: their hashes are in the block hash chain) are computed once and every
later beam request of every step hits them. Only a beam's last, partial block (fewer than
``block_size`` tokens) is recomputed per step, which plays the part of copy-on-write.

    step t:  beams b_1..b_k  --(one request each)-->  top-2k logprobs per beam
             candidates = {(b_i + tok, cum_i + lp)}: best 2k overall, in order
             EOS candidates ranked in the first k  -> finished (score below)
             the first k others                     -> the beams of step t+1
    score of a finished beam = cum_logprob / (num_output_tokens ** length_penalty)

This is HF transformers' rule (``generate(num_beams=k, early_stopping=...)``); with
``ignore_eos`` the EOS token is an ordinary token (vLLM's meaning). The drivers are
``LLM.beam_search`` (offline) and ``api/beam_client.py`` (both HTTP endpoints).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from triptych.engine.sample.sampling_params import SamplingParams

MAX_BEAM_WIDTH = 10  # a step asks for 2k logprobs (the engine returns at most 20; k + 1
# per beam are enough to pick k running beams past one EOS)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` (plus HF's ``early_stopping``)."""

    beam_width: int  # beams kept per step (= sequences returned)
    max_tokens: int | None = 16  # output tokens per beam; None: up to max_model_len
    ignore_eos: bool = False  # EOS is an ordinary token (never finishes a beam)
    temperature: float = 0.0  # must be 0: beams rank the model's own log-probabilities
    length_penalty: float = 1.0  # finished beams score cum_logprob / len ** length_penalty
    early_stopping: bool | str = False  # True: stop at k finished beams; False: once no
    # running beam can beat them (HF's heuristic); "never": not before max_tokens

    def verify(self) -> None:
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam width (n) must be in [1, {MAX_BEAM_WIDTH}] with beam "
                             f"search, got {self.beam_width}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature != 0.0:
            raise ValueError("beam search ranks the model's log-probabilities: temperature "
                             "must be 0")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError("early_stopping must be true, false or \"never\"")


@dataclass
class BeamSequence:
    """One beam: its output tokens, each token's logprobs, and their running sum."""

    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per token: top-2k of
    # the step that chose it (the chosen token included)
    cum_logprob: float = 0.0
    finish_reason: str | None = None  # "stop" (EOS) or "length" once finished
    score: float = 0.0  # cum_logprob / len ** length_penalty, set when it finishes
    tokens: list[int] = field(default_factory=list)  # prompt + output ids (vLLM's field),
    # set in the result
    text: str = ""  # the output's text, set in the result


class BeamSearch:
    """The beams of one prompt. ``pending()`` says what to run; ``advance()`` takes the
    top-2k logprobs of each pending beam's next token; ``result()`` once ``done``."""

    def __init__(self, params: BeamSearchParams, eos_token_id: int | None,
                 max_tokens: int, banned: tuple[int | None, ...] = ()) -> None:
        """``banned``: token ids never chosen (a model's image/video placeholders: a beam
        continues as a prompt, where they would stand for media it does not have)."""
        params.verify()
        self.p, self.k = params, params.beam_width
        self.banned = {t for t in banned if t is not None}
        self.eos = None if params.ignore_eos else eos_token_id
        self.max_tokens = max_tokens  # already capped by the caller to fit max_model_len
        self.running: list[BeamSequence] = [BeamSequence()]
        self.finished: list[BeamSequence] = []
        self.done = False

    def step_params(self) -> SamplingParams:
        """One step of one beam: the next token's logprobs (the token itself is unused)."""
        # NOTE: 2 more than HF's 2k candidates: banned ids may take their places.
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                              logprobs=min(2 * self.k + len(self.banned), 20))

    def pending(self) -> list[list[int]]:
        """The output tokens of each running beam (append them to the prompt)."""
        return [] if self.done else [b.output_token_ids for b in self.running]

    def _score(self, cum: float, length: int) -> float:
        return cum / (length ** self.p.length_penalty)

    def advance(self, step_logprobs: list[dict[int, float]]) -> None:
        assert len(step_logprobs) == len(self.running) and not self.done
        cands = [(b.cum_logprob + lp, i, tok) for i, (b, lps) in
                 enumerate(zip(self.running, step_logprobs)) for tok, lp in lps.items()
                 if tok not in self.banned]
        # NOTE: HF breaks ties by flat index (beam, token): stable sort on that order.
        cands.sort(key=lambda c: (c[1], c[2]))
        cands.sort(key=lambda c: -c[0])
        cands = cands[:2 * self.k]
        length = len(self.running[0].output_token_ids) + 1
        last = length >= self.max_tokens
        nxt: list[BeamSequence] = []
        for rank, (cum, i, tok) in enumerate(cands):
            parent = self.running[i]
            is_eos = tok == self.eos
            if (is_eos or last) and rank < self.k:
                seq = self._child(parent, tok, cum, step_logprobs[i])
                seq.finish_reason = "stop" if is_eos else "length"
                seq.score = self._score(cum, length)
                self.finished.append(seq)
            elif not is_eos and not last and len(nxt) < self.k:
                nxt.append(self._child(parent, tok, cum, step_logprobs[i]))
        self.finished.sort(key=lambda s: -s.score)
        del self.finished[self.k:]
        self.running = nxt
        self.done = last or not nxt or self._stop_early(length)

    @staticmethod
    def _child(parent: BeamSequence, tok: int, cum: float, lps: dict[int, float]
               ) -> BeamSequence:
        return BeamSequence(parent.output_token_ids + [tok], parent.logprobs + [lps], cum)

    def _stop_early(self, length: int) -> bool:
        """HF's rule: with k finished beams, may a running one still do better?"""
        if len(self.finished) < self.k:
            return False
        if self.p.early_stopping is True:
            return True
        worst = self.finished[-1].score
        best_cum = self.running[0].cum_logprob
        if self.p.early_stopping is False:
            return worst >= self._score(best_cum, length)
        # "never": the best score any running beam could still reach
        reach = self.max_tokens if self.p.length_penalty > 0 else length
        return worst >= self._score(best_cum, reach)

    def result(self) -> list[BeamSequence]:
        """The k best beams, best first (running ones count as finished by length)."""
        assert self.done
        return self.finished[:self.k]


@dataclass
class BeamSearchOutput:
    """The result of one prompt (vLLM's shape): ``sequences``, best first."""

    sequences: list[BeamSequence]


def beam_max_tokens(params: BeamSearchParams, num_prompt_tokens: int, max_model_len: int
                    ) -> int:
    """Output tokens per beam: max_tokens, cut so every step request fits max_model_len."""
    room = max_model_len - num_prompt_tokens - 1
    if room < 1:
        raise ValueError(f"the prompt holds {num_prompt_tokens} tokens, which leaves no room "
                         f"for beam search within max_model_len ({max_model_len})")
    return min(params.max_tokens or room, room)


def beam_prompt(prompt: Any, output_token_ids: list[int]) -> Any:
    """One step of one beam: a copy of the processed prompt (a dataclass with
    ``prompt_token_ids`` and ``mm_items``) with the beam's tokens appended. Placeholder
    offsets stay valid (tokens go after them); items are copied so no step's
    bookkeeping leaks into the next."""
    return replace(prompt, prompt_token_ids=prompt.prompt_token_ids + output_token_ids,
                   mm_items=[replace(it) for it in prompt.mm_items], prompt_text=None)


def beam_output(search: BeamSearch, prompt_token_ids: list[int], tokenizer: Any,
                skip_special_tokens: bool = True) -> BeamSearchOutput:
    """The search's k best beams with their full token ids and text filled in."""
    seqs = search.result()
    for s in seqs:
        s.tokens = prompt_token_ids + s.output_token_ids
        s.text = tokenizer.decode(s.output_token_ids, skip_special_tokens=skip_special_tokens)
    return BeamSearchOutput(seqs)
