"""``python -m sdc_operator``: check the settings, then run the kopf operator."""

from __future__ import annotations

import logging
import os
import sys

from .errors import ConfigError
from .settings import OperatorSettings
from .webhook import WebhookSettings

LOG_LEVEL_ENV = "HYPERPOD_SDC_LOG_LEVEL"


def main() -> int:
    level = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = OperatorSettings.from_env()
        WebhookSettings.from_env()
        if settings.auth_mode == "static":
            from .auth import StaticTokens

            assert settings.static_tokens_file is not None
            StaticTokens(settings.static_tokens_file)
    except ConfigError as exc:
        print(f"hyperpod-sdc operator: bad setting: {exc}", file=sys.stderr)
        return 2

    import kopf

    from . import handlers  # noqa: F401  (registers the handlers)

    kopf.run(
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
        standalone=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
