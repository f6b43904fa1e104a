"""A magic queue and a device must not share a name (pure; one rule for the server and
``simulate``).

A device's testflinger-agent takes the jobs of its ``home_queues`` on bare metal (Testflinger's
``GET /v1/job?queue=...``, TESTFLINGER.md §1.5), so a magic queue that is also a device's home
queue would have its jobs run on the bare machine (and the home queue's jobs counted as magic
demand), and a magic queue named like a device agent is refused likewise. The server refuses
the clash from both sides: ``apply`` (server/plugin.py, 422 with :func:`name_clashes`) and an
agent host's registration (server/hostproto.py, 409 with :func:`device_clashes`);
``testflinger-magic simulate`` refuses a modelled lab with the same words (lab/simulate.py).
"""

from __future__ import annotations


def name_clashes(queue_names: list[str], devices: list[dict]) -> dict[str, str]:
    """``{queue: why}`` for each of ``queue_names`` that is the agent name or a home queue of a
    registered device (``devices``: ``magic_devices`` documents), naming the device(s)."""
    out = {}
    for name in queue_names:
        agents = sorted(d["_id"] for d in devices if d.get("_id") == name)
        homes = sorted(d["_id"] for d in devices if name in (d.get("home_queues") or ()))
        if agents:
            out[name] = (f"{name!r} is the agent name of registered device {agents[0]}; a magic "
                         "queue needs a name no device agent uses")
        elif homes:
            out[name] = (f"{name!r} is the home queue of registered device(s) "
                         f"{', '.join(homes)}: their agents would take this magic queue's jobs on "
                         "bare metal, and their owners' jobs would count as magic demand; "
                         "choose another name")
    return out


def device_clashes(devices: list[dict], magic_names: set[str]) -> list[str]:
    """Why each device of a registration (dicts with ``agent_name``, ``home_queues``) clashes
    with an applied magic queue (``magic_names``): its agent name or a home queue is one."""
    out = []
    for d in devices:
        name = d.get("agent_name")
        if name in magic_names:
            out.append(f"device {name}: its agent name is the magic queue {name!r}")
        for home in d.get("home_queues") or ():
            if home in magic_names:
                out.append(f"device {name}: its home queue {home!r} is a magic queue (its agent "
                           "would take that queue's jobs on bare metal); rename the home queue "
                           "or the magic queue")
    return out
