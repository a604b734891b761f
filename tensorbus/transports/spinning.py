"""How a waiting receive's spin reads a miss: the rule tensorbus.aio's socket consumer and shm:// share.

A receive that waits polls for `spin_s` before it sleeps (an idle vCPU wakes late). In a ping-pong whose
other end once slept (a round's first receive waited long, the machine was busy a moment), that end's
reply comes after its own wake-up and its work: later than `spin_s`. So this end's spin runs out and it
sleeps too, the other waits as long in turn, and the round trip is two wake-ups, round after round. If the
bytes came within NEAR_MISS spins after the spin ran out, it was a near miss: the next spin lasts STRETCH
spins, catches the reply of an end that slept, and its own reply then comes within the other end's spin.
"""

from __future__ import annotations

#: bytes that came within this many `spin_s` after a spin ran out make it a near miss: the peer answered,
#: only late by its own wake-up from a sleep and its work (the waiter's own wake-up counted in)
NEAR_MISS = 2.0
#: the spin after a near miss lasts this many `spin_s`: long enough for a peer's wake-up (~100 µs on an idle
#: vCPU of the 2-vCPU VM) and its reply, so that one end at least stays awake
STRETCH = 3.0
