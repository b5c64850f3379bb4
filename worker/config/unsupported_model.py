"""The one error for a checkpoint pdserve cannot run: an architecture, rope type, layer layout or
quantization format it does not implement. The server reports it as such (not as a crash), so
every reader of a model's config raises this type, with the key and value it cannot run."""


class UnsupportedModelError(ValueError):
    pass
