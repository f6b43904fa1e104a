"""The lease steps: ``STEPS``, one function per lease state, and the names steps share.

``STEPS[state](ctx) -> StepResult`` does the work the daemon owes a lease in ``state``
(docs/architecture.md, "States"): ``claimed`` fences, ``fenced`` deploys, ``deploying`` waits for
Deployed, ``splitting`` splits, ``enrolling`` enrols the VMs and adds their agent programs
(pre-warmed ones started but waiting on their go file, prewarm.py; the others not started),
``active`` writes the go files and starts the others, and re-creates VM agent folders and
programs a charm wiped, ``restoring`` tears everything down.

A step's result may name a step to run at once after its report was accepted
(``StepResult.after_report``): the enroll step's is ``check_active``, so the VM agents run
only once the server has moved the lease to ``active`` and lifted their fences, and their first
job poll can take a job.

Rules every step keeps:
- it looks at what exists before acting, so running it twice (after a crash) is harmless;
- each external effect is journaled ``begin`` before / ``done`` after (journal.Journal.effect);
- tear-down finds what to undo by DISCOVERY (programs, folders, MAAS hostnames and libvirt domains
  named ``<device>-vm<N>``/carrying the lease id) as well as from the journal and the lease, so a
  SIGKILL between an effect and its journal line orphans nothing;
- errors are raised (``StepError`` or a driver error); the daemon reports them;
- every wait watches ``ctx.stop``: once the daemon is stopping it raises ``Interrupted``, which
  is not an error (the next daemon start runs the step again from the server's state).

Where they live: the shared context, results, errors and pure helpers in stepcontext.py, the
bring-up steps in bringup.py, the tear-down step in teardown.py; this module re-exports them
(``steps.StepContext``, ``steps.restore``, ...) and holds the ``STEPS`` table.
"""

from __future__ import annotations

# Re-exports: the daemon, tests and docs name these as ``steps.<name>``.
from testflinger_magic.agent_host.bringup import (  # noqa: F401
    _check_domain, _device_ip, _is_our_machine, _make_plan, _our_vm_machine, _record_bridge,
    _retry, _template_dir, _vm_bridge, _wait_commissioned, _wait_host_ready, check_active,
    deploy, enroll, fence, split, wait_deployed,
)
from testflinger_magic.agent_host.maas import Interrupted  # noqa: F401
from testflinger_magic.agent_host.marks import vm_name_pattern  # noqa: F401
from testflinger_magic.agent_host.stepcontext import (  # noqa: F401
    ALLOCATED, COMMISSION_FAIL, DEFAULT_DISK_DIR, DEPLOY_FAIL, DEPLOYED, DEPLOYING,
    FAILED_DEPLOYMENT, NEW, READY, RELEASE_FAIL, RUNNING_STATES, Drivers, GiveBackRefused,
    StepContext, StepError, StepResult, _ip_of, _parallel, agent_context, bridge_of,
    check_vm_names, plan_vms, vm_host_user_data,
)
from testflinger_magic.agent_host.teardown import (  # noqa: F401
    _remove_folder, discover_vm_names, gpus_back_problems, restore, verify_gpus_back,
)



#: The step the daemon runs for a lease in each state.
STEPS = {
    "claimed": fence,
    "fenced": deploy,
    "deploying": wait_deployed,
    "splitting": split,
    "enrolling": enroll,
    "active": check_active,
    "restoring": restore,
}
