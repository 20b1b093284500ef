"""fastgen's native wire format: a :class:`Response` as JSON and back.

Used by ``POST /generate`` and by :mod:`fastgen.client`, so that a client gets the very
objects the in-process pipeline returns. Kept free of web-framework imports.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..request import FinishReason, Response, Timings, TokenLogprob


def response_to_json(r: Response) -> dict[str, Any]:
    body = dataclasses.asdict(r)
    body["finish_reason"] = r.finish_reason.value
    return body


def response_from_json(body: dict[str, Any]) -> Response:
    def logprobs(items: list[dict] | None) -> tuple[TokenLogprob, ...] | None:
        if items is None:
            return None
        return tuple(TokenLogprob(token_id=d["token_id"], logprob=d["logprob"],
                                  top={int(k): v for k, v in d["top"].items()}) for d in items)

    t = body["timings"]
    return Response(
        request_id=body["request_id"], generated_text=body["generated_text"],
        token_ids=tuple(body["token_ids"]), prompt_length=body["prompt_length"],
        generated_length=body["generated_length"], finish_reason=FinishReason(body["finish_reason"]),
        timings=Timings(queue_wait_s=t["queue_wait_s"], time_to_first_token_s=t["time_to_first_token_s"],
                        token_times_s=tuple(t["token_times_s"]), e2e_s=t["e2e_s"]),
        logprobs=logprobs(body.get("logprobs")), prompt_logprobs=logprobs(body.get("prompt_logprobs")),
        num_preemptions=body.get("num_preemptions", 0), error=body.get("error"),
        num_cached_tokens=body.get("num_cached_tokens", 0))
