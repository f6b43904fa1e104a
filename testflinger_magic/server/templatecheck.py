"""Warn at apply about a queue whose ``agent_template`` no registered agent host has (pure).

Each daemon tells the server, when it registers, the template folders under its
``agent_templates_dir`` (agentfolders.template_names; stored as ``magic_agent_hosts.templates``).
A queue naming a folder none of them has would fail every bring-up at the fence (blamed on the
queue, the queue suspended: TRIAL 2026-12-02 finding 1); ``apply`` says so at once. Hosts that
did not say (a daemon before this, or none registered) are not judged: no warning without
facts.
"""

from __future__ import annotations


def template_warnings(definitions, hosts: list[dict]) -> list[str]:
    """One message per queue of ``definitions`` (MagicQueue) whose ``agent_template`` is in no
    ``templates`` list of ``hosts`` (``magic_agent_hosts`` documents; those without the field
    are left out). ``[]`` when no host reported its templates."""
    known = {h["_id"]: list(h["templates"]) for h in hosts
             if isinstance(h.get("templates"), list)}
    if not known:
        return []
    have = {t for names in known.values() for t in names}
    out = []
    for q in definitions:
        if q.agent_template not in have:
            listed = "; ".join(f"{h}: {', '.join(names) or 'none'}"
                               for h, names in sorted(known.items()))
            out.append(f"{q.name}: agent_template {q.agent_template!r} is on no registered "
                       f"agent host ({listed}); its bring-ups will fail and suspend the queue")
    return out
