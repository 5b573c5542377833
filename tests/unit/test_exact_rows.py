"""calid.bench.invariance.exact_rows against a stand-in runner whose rows change past a known call size."""
import torch

from calid.bench.invariance import exact_rows

V = 11


class Runner:
    """Rows that depend only on a token's position and id, unless a call feeds a sequence more than ``exact``
    tokens: then they move by a rounding-sized amount, as a batched kernel's do."""

    def __init__(self, exact: int):
        self.exact, self.seqs = exact, {}

    def release(self, seq):
        self.seqs.pop(seq, None)

    def forward(self, inputs):
        out = []
        for inp in inputs:
            past = self.seqs.setdefault(inp.seq_id, [])
            rows = []
            for i, t in enumerate(inp.tokens):
                row = torch.zeros(V)
                row[(3 * t + len(past) + i) % V] = 1.0
                if len(inp.tokens) > self.exact and inp.logits_at is not None:
                    row += 1e-6
                rows.append(row)
            past += inp.tokens
            at = inp.logits_at if inp.logits_at is not None else [len(rows) - 1]
            out.append(torch.stack([rows[i] for i in at]))
        return out


def test_the_largest_exact_call_is_the_last_size_whose_rows_equal_one_token_steps():
    for exact in (1, 3, 7, 16):
        found, step_ms = exact_rows(Runner(exact), list(range(20)), most=12)
        assert found == min(exact, 12) and step_ms >= 0
