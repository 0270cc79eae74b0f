"""The stack schema: the whole deployment intent of one environment, validated once.

``stacks/Pulumi.<env>.yaml`` holds it under ``config:`` with one project key per
section (``specdeploy:model``, ``specdeploy:fleet``, ...). The Pulumi program, the
local platform, the launch validation and the release tooling all read it
through :class:`StackConfig`; the server's own config file is rendered from it
(:func:`render_server_config`), never written twice by hand.

One module per group of sections: ``server`` (the sections shared with the server's
config: model, speculative, service, local), ``aws`` (fleet), ``access``, ``alerting``
(alerting, slo), ``kubernetes``, ``release`` (the blue/green slots and :func:`other_slot`);
``stack`` puts them together and reads stack files, ``project`` finds them, ``reference``
writes the generated config reference. This package is what the rest of infra/ imports.

It imports neither pulumi nor torch: ``specdeploy config validate`` must start in a
fraction of a second.
"""

from infra.config.access import OPEN_CIDRS, AccessSpec
from infra.config.alerting import AlertingSpec, SloSpec
from infra.config.aws import KEEP_ALIVE_MARGIN_S, FleetSpec, ScaleSchedule, load_balancer_idle_timeout_s
from infra.config.kubernetes import KubernetesSpec, Toleration
from infra.config.project import (
    PROJECT,
    PROJECT_FILE,
    REPO_ROOT,
    available_stacks,
    find_project_dir,
    project_dir,
    project_stacks_dir,
    stack_path,
    use_project,
)
from infra.config.release import SLOTS, ReleaseSpec, Slot, SlotServerSpec, SlotSpec, other_slot
from infra.config.server import (
    MODEL_CACHE_DIR,
    LocalSpec,
    ModelSpec,
    ServiceSpec,
    SpeculativeSpec,
    render_server_config,
    server_keep_alive_s,
)
from infra.config.stack import (
    SECRET_FIELDS,
    SECRET_MASK,
    Platform,
    StackConfig,
    StackFile,
    config_key,
    from_pulumi,
    load_stack,
    masked_dump,
    parse_stack_mapping,
)
from serving.config import ConfigError

__all__ = [
    "KEEP_ALIVE_MARGIN_S", "MODEL_CACHE_DIR", "OPEN_CIDRS", "PROJECT", "PROJECT_FILE", "REPO_ROOT", "SECRET_FIELDS",
    "SECRET_MASK", "SLOTS", "AccessSpec", "AlertingSpec", "ConfigError", "FleetSpec", "KubernetesSpec", "LocalSpec",
    "ModelSpec", "Platform", "ReleaseSpec", "ScaleSchedule", "ServiceSpec", "Slot", "SlotServerSpec", "SlotSpec",
    "SloSpec", "SpeculativeSpec", "StackConfig", "StackFile", "Toleration", "available_stacks", "config_key",
    "find_project_dir", "from_pulumi", "load_balancer_idle_timeout_s", "load_stack", "masked_dump", "other_slot",
    "parse_stack_mapping", "project_dir", "project_stacks_dir", "render_server_config", "server_keep_alive_s",
    "stack_path", "use_project",
]
