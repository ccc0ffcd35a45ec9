"""Condense out_*.txt (harness runs) into one markdown block per library: command, exit, lines, traceback?, message."""
import re, sys
def cases(path):
    text = open(path).read()
    for block in re.split(r'\n(?=\$ python )', text):
        lines = block.strip().splitlines()
        if not lines: continue
        if lines[0].startswith('###'):
            head, lines = lines[0], lines[1:]
            if not lines: continue
        cmd = lines[0]; body = lines[1:]
        m = [l for l in body if l.startswith('[exit ')]
        rc = m[-1] if m else '?'
        body = [l for l in body if not l.startswith('[exit ') and not l.startswith('###')]
        tb = any(l.startswith('Traceback') for l in body)
        # the meaningful message: last non-frame lines
        msg = [l.rstrip() for l in body if l.strip() and not l.startswith('  File ') and not l.startswith('    ')
               and not re.match(r'^\s*\[--|^usage:|^\s{5,}\[|^tip:', l) and not l.startswith('Traceback')
               and 'During handling' not in l and 'direct cause' not in l]
        yield cmd, rc, len(body), tb, msg[-4:]
for path in sys.argv[1:]:
    print(f"#### {path}\n```")
    for cmd, rc, n, tb, msg in cases(path):
        print(cmd); print(f"  -> {rc} | {n} lines of output | traceback: {'yes' if tb else 'no'}")
        for l in msg: print("  | " + l[:230])
    print("```\n")
