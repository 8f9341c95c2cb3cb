"""Speculative decoding from the context: drafts are n-gram continuations found in the prompt
and the answer so far (the KV's own keys: no second model, no extra store), verified in one
forward pass that yields the logits of every drafted position.

Exact by construction. The forward pass gives a token's logits the same bits whatever the
pass's size (pyx/ks_forward.h), so the logits row of a drafted position is the row plain
decode would have computed there, given that the drafts before it were the tokens actually
chosen. The decode loop samples every token from its row as it always does, penalties,
grammar and seeded draws included, and a draft is "accepted" exactly when the chosen token
equals it: for a draft token t this accepts with probability p(t) and otherwise draws from p
without t, renormalized, which is the rule that keeps the model's distribution. The random
generator is drawn once per token, as without speculation, so greedy and seeded outputs are
the same ids as with `--no-speculate`. Rejected rows are cut from the KV cache.

Draft sources, chosen on SmolLM2's answers (docs/speculation.md has the measurements): the
context's last 3-gram at the earlier occurrence whose preceding tokens match the context's
furthest back (up to MATCH_BACK tokens; the most recent among equals), continued for up to
`length` tokens. Where no 3-gram repeats, the last 2-gram's most recent occurrence drafts up to
DRAFT_LENGTHS[0] tokens: right after the answer leaves its source (a word changed), the 3-gram
holding the new word is nowhere, and the 2-gram after it finds the source again.
A pass is the draft plus the chosen token, and the products compute tokens in tiles of 1, 2,
4 or 8 (pyx/ks_q8.h's KS_TOKEN_TILES): a pass of 2-4 tokens costs little more than one token,
and a 5th token starts the next width (docs/speculation.md has the figures). So `length` is 3
or 7, filling a tile: 3 at first, 7 after a draft of 3 accepted whole, and back to 3 after a
draft of which fewer than 3 were taken. A pass over more tokens still costs more than one, so
after a 3-gram's pass that took less than half its draft the drafter rests for a number of
tokens that doubles with each such pass in a row (up to MAX_REST) and starts again at 1 after
a pass that gained. A 2-gram's refused draft does not count: it is short, so cheap, and says
nothing of the 3-grams to come.
"""
from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np

N_GRAMS = (3, 2)          # n-gram sizes matched, longest first; the last is a short fallback
MATCH_BACK = 8            # most tokens compared when choosing among a 3-gram's occurrences
DRAFT_LENGTHS = (3, 7)    # a pass of a draft and the chosen token fills a tile of 4 or 8
MAX_DRAFT = DRAFT_LENGTHS[-1]
MAX_REST = 32             # most tokens decoded without drafting after passes that did not pay


class Drafter:
    """Proposes the next tokens of a sequence from its own earlier n-grams.

    `context`: the prompt's ids; `push` appends each chosen token. `exclude`: ids never
    drafted (a Qwen3-VL image's placeholder tokens): a draft stops before the first."""

    def __init__(self, context, capacity: int, exclude=()):
        self.ids = np.zeros(capacity, np.int64)
        self.n = min(len(context), capacity)
        self.ids[:self.n] = context[:self.n]
        self.exclude = np.array(sorted(exclude), np.int64)
        self.length = DRAFT_LENGTHS[0]
        self.rest = 0             # tokens to decode before drafting again
        self.rest_next = 1        # the next rest after a pass that does not pay
        self.fallback = False     # the last draft came from a 2-gram

    def push(self, tok: int) -> None:
        """Appends a chosen token."""
        if self.n < len(self.ids):
            self.ids[self.n] = tok
            self.n += 1

    def draft(self, room: int) -> list:
        """Up to min(length, room) tokens that may follow the context (up to DRAFT_LENGTHS[0]
        from a 2-gram), or [] (nothing found, resting, or no room)."""
        if self.rest > 0:
            self.rest -= 1
            return []
        if room <= 0:
            return []
        ids, n = self.ids[:self.n], self.n
        for size in N_GRAMS:
            if n <= size:
                continue
            tail = ids[n - size:]
            # windows ending before the tail's own last token: starts 0 .. n - size - 1
            hits = np.ones(n - size, bool)
            for j in range(size):
                hits &= ids[j:n - size + j] == tail[j]
            found = np.flatnonzero(hits)
            if not len(found):
                continue
            start = self._best(found, size) + size
            self.fallback = size < N_GRAMS[0]
            k = min(DRAFT_LENGTHS[0] if self.fallback else self.length, room)
            out = ids[start:start + k]
            if len(self.exclude):
                bad = np.flatnonzero(np.isin(out, self.exclude))
                out = out[:bad[0]] if len(bad) else out
            return [int(t) for t in out]
        return []

    def _best(self, found: np.ndarray, size: int) -> int:
        """Of the occurrences starting at `found` (ascending) of the context's last `size`
        ids, the one whose preceding ids match the context's for the most tokens (up to
        MATCH_BACK in all), the most recent among equals."""
        ids, n = self.ids, self.n
        longer = np.zeros(len(found), np.int64)
        alive = np.ones(len(found), bool)
        for j in range(1, min(MATCH_BACK - size, n - size) + 1):
            before = found - j
            alive &= before >= 0
            alive[alive] &= ids[before[alive]] == ids[n - size - j]
            if not alive.any():
                break
            longer += alive
        return int(found[len(found) - 1 - int(np.argmax(longer[::-1]))])

    def verified(self, drafted: int, accepted: int) -> None:
        """A pass of `drafted` tokens of which the first `accepted` were chosen."""
        want = 2 * drafted + 1 if accepted == drafted else accepted + 1
        self.length = next((n for n in DRAFT_LENGTHS if n >= want), MAX_DRAFT)
        if self.fallback:
            return
        if 2 * accepted < drafted:       # less than half taken: the pass cost more than it gave
            self.rest = self.rest_next
            self.rest_next = min(2 * self.rest_next, MAX_REST)
        else:
            self.rest_next = 1


class Feeder:
    """Feeds each chosen token to the forward pass and returns the logits of the position
    after it: from a pass of its own, or from the pass that verified it as a draft.

    The KV cache's valid rows end after the last chosen token that was fed; `finish` cuts
    the rows of drafts that were never chosen."""

    def __init__(self, forward, drafter: Optional[Drafter], rope_delta: int = 0):
        self.forward = forward
        self.kv = forward.kv
        self.drafter = drafter
        self.rope_delta = rope_delta
        self.max_pass = min(MAX_DRAFT + 1, forward.max_chunk)
        self.rows = np.empty((self.max_pass, forward.config.vocab), np.float32)
        self.queue: deque = deque()     # (draft token, logits row after it), in order
        self.valid = self.kv.cache_len  # rows of chosen tokens
        self.drafted = 0
        self.accepted = 0
        self._pass_drafted = 0
        self._pass_accepted = 0

    def next_logits(self, tok: int, remaining: int) -> np.ndarray:
        """Logits (1, vocab) after the chosen token `tok`; `remaining`: tokens the answer may
        still have after tok (no use drafting past them)."""
        if self.drafter is not None:
            self.drafter.push(tok)
        if self.queue and self.queue[0][0] == tok:
            _, row = self.queue.popleft()
            self.valid += 1
            self.accepted += 1
            self._pass_accepted += 1
            if not self.queue:
                self._close_pass()
            return row
        if self.queue:
            self.queue.clear()
            self._close_pass()
        self.kv.truncate(self.valid)
        room = min(self.max_pass - 1, remaining - 1, self.kv.max_seq - self.valid - 1)
        draft = self.drafter.draft(room) if self.drafter is not None and room > 0 else []
        pos = self.valid
        rope = pos + self.rope_delta if self.rope_delta else None
        self.valid += 1
        if not draft:
            return self.forward([tok], rope_pos0=rope)
        rows = self.rows[:1 + len(draft)]
        self.forward([tok] + draft, logits_out=rows, rope_pos0=rope)
        self.queue.extend(zip(draft, rows[1:, None]))
        self.drafted += len(draft)
        self._pass_drafted, self._pass_accepted = len(draft), 0
        return rows[:1]

    def finish(self) -> None:
        """Cuts the rows of drafts that were not chosen: the cache holds the chosen tokens."""
        if self.queue:
            self.queue.clear()
            self._close_pass()
        self.kv.truncate(self.valid)

    def _close_pass(self) -> None:
        if self.drafter is not None and self._pass_drafted:
            self.drafter.verified(self._pass_drafted, self._pass_accepted)
        self._pass_drafted = self._pass_accepted = 0
