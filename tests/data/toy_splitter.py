#!/usr/bin/env python3
"""A toy split script following docs/script-splitter.md (state in a JSON file, no real VMs).

Environment: TOY_SPLIT_STATE (state file path, required), TOY_GPUS (number of GPUs, default 8).
"""
import json
import os
import sys


def main():
    req = json.load(sys.stdin)
    path = os.environ["TOY_SPLIT_STATE"]
    gpus = [f"0000:{0x01 + 0x10 * i:02x}:00.0" for i in range(int(os.environ.get("TOY_GPUS", 8)))]
    state = json.load(open(path)) if os.path.exists(path) else {"domains": {}}
    doms = state["domains"]
    action = req["action"]
    if action == "discover":
        out = {"gpus": [{"address": a, "iommu_group": 10 + i, "functions": [a],
                         "numa_node": i * 2 // len(gpus), "vendor_id": "0x10de",
                         "product_id": "0x20b0"} for i, a in enumerate(gpus)]}
    elif action == "split":
        used = {g for d in doms.values() for g in d["gpus"]}
        results = []
        for vm in req["vms"]:
            dom = doms.get(vm["name"])
            if dom and dom["lease_id"] != req["lease_id"]:
                print(json.dumps({"error": f"domain {vm['name']} belongs to {dom['lease_id']}"}))
                return 1
            if not dom:
                free = [g for g in gpus if g not in used]
                if len(free) < vm["gpu_count"]:
                    print(f"not enough GPUs for {vm['name']}", file=sys.stderr)
                    return 2
                dom = {"lease_id": req["lease_id"], "mac": vm["mac"],
                       "gpus": free[:vm["gpu_count"]], "disk": vm["disk_path"]}
                used.update(dom["gpus"])
                doms[vm["name"]] = dom
            results.append({"name": vm["name"], "domain": vm["name"], "mac": dom["mac"],
                            "gpus": dom["gpus"], "disk": dom["disk"]})
        out = {"vms": results}
    elif action == "restore":
        names = req.get("names")
        for name in [n for n, d in doms.items() if d["lease_id"] == req["lease_id"]]:
            if names is None or name in names:
                del doms[name]
        out = {}
    elif action == "domains":
        out = {"domains": sorted(n for n, d in doms.items()
                                 if req.get("lease_id") in (None, d["lease_id"]))}
    elif action == "gpus_free":
        out = {"gpus_free": not any(d["gpus"] for d in doms.values())}
    else:
        print(json.dumps({"error": f"unknown action {action!r}"}))
        return 64
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
