"""Whether a Hub id can be had: one request, before a loader's own client would retry an unreachable host for half a
minute. Its own module so that a data source's check loads neither torch nor transformers."""

from __future__ import annotations

import functools
from pathlib import Path

# the way on when a Hub id cannot be had because the Hub cannot be reached
NO_HUB = ("without the Hub, the offline recipe trains its own models: python -m tools.recipe offline-cpu --imdb "
          "<IMDb folder> --tokenizer <GPT-2 tokenizer folder> (README)")


@functools.cache
def unreachable_hub_id(value: str, repo_type: str) -> str | None:
    """Why ``value`` (not a local path) cannot be had from the Hub as a ``repo_type`` ('model', 'dataset'); None when
    it can, or when it is in the local Hub cache (the loader then decides).

    One request and no retries: the loaders' own client retries an unreachable host for half a minute before saying
    so. An answer other than "no such repository" or "cannot connect" (a gated repo, a rate limit) is left to the
    loader to report.
    """
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError
    from huggingface_hub.file_download import repo_folder_name

    try:
        if (Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=value, repo_type=repo_type)).is_dir():
            return None
        if constants.HF_HUB_OFFLINE:
            return f"HF_HUB_OFFLINE is set and it is not in the Hub cache; {NO_HUB}"
        HfApi().repo_info(value, repo_type=repo_type, timeout=10)
    except (RepositoryNotFoundError, HFValidationError) as e:
        return str(e).splitlines()[0]
    except HfHubHTTPError:
        return None
    except Exception as e:  # offline mode, DNS, refused or timed-out connections: each its own type
        return f"cannot reach the Hub: {str(e).splitlines()[0]}; {NO_HUB}"
    return None
