"""Chapter 2's request contract plus the sampling fields (``temperature``, ``top_k``, ``top_p``, ``seed``, as in the OpenAI
route): what chapter 8's ``/v1/inference`` accepts; a checked request travels to the backend as a :class:`SampledRequest`."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field, StrictInt

from chapters.ch02_fastapi_async.api import RequestContract
from chapters.ch08_continuous_batching.sampling import GREEDY, MAX_TEMPERATURE, SamplingParams
from chapters.ch08_continuous_batching.scheduler import StopCondition
from shared.schemas import ContractLimits, InferenceRequest, ValidRequest, checked_prompt, read_inference_request
from shared.tokenizer import Tokenizer


@dataclass(frozen=True)
class SampledRequest(ValidRequest):
    """A checked request that also says how to pick its tokens and when to stop."""

    sampling: SamplingParams = GREEDY
    stop: StopCondition | None = None


class SampledInferenceRequest(InferenceRequest):
    """The contract's request body, plus the sampling fields (absent: greedy)."""

    temperature: float = Field(0.0, ge=0, le=MAX_TEMPERATURE, description="0: greedy (the default); else sample at this temperature")
    top_k: StrictInt = Field(0, ge=0, description="sample only among the k most likely tokens (0: no limit)")
    top_p: float = Field(1.0, gt=0, le=1, description="sample only within the smallest most likely set of mass >= top_p (1: no limit)")
    seed: StrictInt | None = Field(None, description="the request's own random stream: same seed, same tokens, batched or not")

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)


def parse_sampled_request(body: bytes, limits: ContractLimits, tokenizer: Tokenizer) -> SampledRequest:
    """Chapter 2's checks, then the sampling fields; 422 for any out of range."""
    request = read_inference_request(body, limits, SampledInferenceRequest)
    return SampledRequest(checked_prompt(request, limits, tokenizer), request.max_new_tokens, sampling=request.sampling())


SAMPLED_CONTRACT = RequestContract(SampledInferenceRequest, parse_sampled_request)
