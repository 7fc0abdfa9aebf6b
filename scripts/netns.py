"""A network namespace joined to this one by a veth pair, for tests that
put processes where some addresses cannot be reached: this side is
10.<subnet>.0.1, the namespace's 10.<subnet>.0.2. Processes in the
namespace reach this side's unix sockets (they are files) and 10.x.0.1, not
its 127.0.0.1. Needs root (ip netns)."""
import os
import subprocess


class Link:
    def __init__(self, tag, subnet):
        suffix = str(os.getpid() % 100000)
        self.HOST, self.INSIDE = f"10.{subnet}.0.1", f"10.{subnet}.0.2"
        self.ns, self.outer, self.inner = f"wsync-{tag}-{suffix}", f"w{tag[:3]}o{suffix}", f"w{tag[:3]}i{suffix}"
        for cmd in (["ip", "netns", "add", self.ns],
                    ["ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner],
                    ["ip", "link", "set", self.inner, "netns", self.ns],
                    ["ip", "addr", "add", f"{self.HOST}/30", "dev", self.outer],
                    ["ip", "link", "set", self.outer, "up"],
                    ["ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{self.INSIDE}/30", "dev", self.inner],
                    ["ip", "netns", "exec", self.ns, "ip", "link", "set", self.inner, "up"],
                    ["ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up"]):
            subprocess.run(cmd, check=True, capture_output=True)

    def inside(self, argv):
        """`argv` run in the namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def set(self, up):
        subprocess.run(["ip", "link", "set", self.outer, "up" if up else "down"], check=True, capture_output=True)

    def close(self):
        subprocess.run(["ip", "link", "del", self.outer], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
