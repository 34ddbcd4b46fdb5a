"""Independent ICRC check of a capture: recomputes every RoCEv2 packet's ICRC with scapy's
implementation (scapy.contrib.roce) and compares it with the four bytes on the wire.
Prints 'checked N mismatched M' and exits non-zero on any mismatch."""
import sys

from scapy.all import UDP, raw, rdpcap
from scapy.contrib.roce import BTH

checked = mismatched = 0
for p in rdpcap(sys.argv[1]):
    if BTH not in p or UDP not in p:
        continue
    checked += 1
    wire = raw(p[UDP].payload)[-4:]
    want = p[BTH].compute_icrc(None)
    if wire != want:
        mismatched += 1
        print(f"mismatch: wire {wire.hex()} scapy {want.hex()} {p.summary()}")
print(f"checked {checked} mismatched {mismatched}")
sys.exit(1 if mismatched or not checked else 0)
