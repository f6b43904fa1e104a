"""testflinger-magic: magic queues for Testflinger.

A magic queue is a virtual Testflinger queue whose agents are created on demand: an idle
multi-GPU device is lent (its agent fenced and stopped), deployed with MAAS, split with libvirt
into one VM per GPU, and each VM gets its own testflinger-agent on the magic queue. See
docs/architecture.md.
"""

__version__ = "0.1.0"
