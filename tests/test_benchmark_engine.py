"""The engine benchmark's decode-only aggregate of several streams (`benchmarks.engine.decode_only_tok_s`)."""
from benchmarks.engine import decode_only_tok_s
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import RequestMetrics


def _output(tokens: int, first_token_time: float, finished_time: float) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=first_token_time,
                             finished_time=finished_time, num_output_tokens=tokens)
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2], prompt_logprobs=None,
                         outputs=[CompletionOutput(0, "", list(range(tokens)), None, "length")],
                         finished=True, num_cached_tokens=0, metrics=metrics)


def test_decode_only_leaves_the_prefill_and_first_tokens_out():
    """Two streams whose prompts took 2 s to prefill (first tokens at 2.0 and 2.5 s), then 10 tokens
    each until 4.5 and 4.0 s: 18 tokens after the firsts, over 4.5 - 2.5 = 2 s."""
    outs = [_output(10, 2.0, 4.5), _output(10, 2.5, 4.0)]
    assert decode_only_tok_s(outs) == 18 / 2.0
