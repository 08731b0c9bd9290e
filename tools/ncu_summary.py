#!/usr/bin/env python3
"""A few lines per kernel from Nsight Compute's text output (ncu ... --section SpeedOfLight ...).

usage: ncu_summary.py FILE [FILE ...]   (each the stdout of one `ncu` run; '-' reads stdin)

Per profiled launch: the kernel (name without parameters), grid x block, duration, SM / memory /
DRAM throughput (% of peak), the tensor pipes' active cycles where --metrics asked for them,
issue slots busy, achieved occupancy, eligible warps per scheduler, cycles between issues, and the
top stall as the WarpStateStats rule words it (its share of the cycles between two issues).
"""
import re
import sys

HEAD = re.compile(r'^\s{2}(?:void )?(\S.*?)\s+\((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Context \d+, Stream \d+')
ROW = re.compile(r'^\s{4}(\S.*?\S)\s{2,}(\S+)\s+([-\d.,]+)\s*$')
ROW_NOUNIT = re.compile(r'^\s{4}(\S.*?\S)\s{2,}([-\d.,]+)\s*$')
STALL = re.compile(r'spends ([\d.]+) cycles being stalled (.*?)\. This stall type represents about ([\d.]+)% of the total '
                   r'average of ([\d.]+) cycles')
UNIT_MS = {'ms': 1.0, 'msecond': 1.0, 'us': 1e-3, 'usecond': 1e-3, 'ns': 1e-6, 'nsecond': 1e-6, 's': 1e3, 'second': 1e3}


def num(s):
    try:
        return float(s.replace(',', ''))
    except ValueError:
        return None


def short(name):
    # "<unnamed>::kda3_state_k<4, 1, true>(int, int, ...)" -> "kda3_state_k<4, 1, true>"
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):
        if ch == '<':
            depth += 1
        elif ch == '>':
            depth -= 1
        elif ch == '(' and depth == 0:
            cut = i
            break
    n = name[:cut]
    for p in ('(anonymous namespace)::', '<unnamed>::'):
        n = n.replace(p, '')
    return n


def parse(text):
    kernels, cur, lines = [], None, []

    def close():
        if cur is not None:
            flat = re.sub(r'\s+', ' ', ' '.join(lines))
            m = STALL.search(flat)
            if m:
                why = m.group(2).split('. ')[0]  # the reason, without the rule's advice
                cur['stall'] = f'{m.group(3)}% of the {m.group(4)} cycles between issues: stalled {why}'
            kernels.append(cur)

    for line in text.splitlines():
        h = HEAD.match(line)
        if h:
            close()
            cur = {'name': short(h.group(1)), 'grid': f'({h.group(2)},{h.group(3)},{h.group(4)})x({h.group(5)},{h.group(6)},{h.group(7)})',
                   'm': {}}
            lines = []
            continue
        if cur is None:
            continue
        lines.append(line.strip())
        r = ROW.match(line)
        if r:
            cur['m'].setdefault(r.group(1), (r.group(2), num(r.group(3))))
        else:
            r = ROW_NOUNIT.match(line)
            if r:
                cur['m'].setdefault(r.group(1), ('', num(r.group(2))))
    close()
    return kernels


def fmt(k):
    m = k['m']

    def g(name, f='{:.1f}'):
        v = m.get(name)
        return f.format(v[1]) if v and v[1] is not None else 'n/a'

    d = m.get('Duration')
    dur = f'{d[1] * UNIT_MS.get(d[0], float("nan")):.3f} ms' if d and d[1] is not None else 'n/a'
    tensor = [f'{name.split(".")[0].replace("sm__pipe_", "").replace("_cycles_active", "")} {v[1]:.1f}%'
              for name, v in m.items() if name.startswith('sm__pipe_tensor') and v[1] is not None]
    out = [f"{k['name']} {k['grid']}: {dur}; SM {g('Compute (SM) Throughput')}%, memory {g('Memory Throughput')}%, "
           f"DRAM {g('DRAM Throughput')}%, L1 {g('L1/TEX Cache Throughput')}%, L2 {g('L2 Cache Throughput')}%"
           + (f"; tensor pipe {', '.join(tensor)}" if tensor else '')]
    out.append(f"    issue slots busy {g('Issue Slots Busy')}%, IPC {g('Executed Ipc Active', '{:.2f}')}, "
               f"occupancy {g('Achieved Occupancy')}% (theoretical {g('Theoretical Occupancy')}%), "
               f"eligible warps/scheduler {g('Eligible Warps Per Scheduler', '{:.2f}')}, no eligible {g('No Eligible')}%, "
               f"registers {g('Registers Per Thread', '{:.0f}')}, waves {g('Waves Per SM', '{:.2f}')}")
    out.append(f"    top stall: {k.get('stall', 'n/a (no WarpStateStats rule text)')}")
    return '\n'.join(out)


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ('-h', '--help'):
        print(__doc__)
        return 0 if len(sys.argv) >= 2 else 2
    for path in sys.argv[1:]:
        text = sys.stdin.read() if path == '-' else open(path, errors='replace').read()
        ks = parse(text)
        print(f'== {path}: {len(ks)} profiled launch(es)')
        if not ks:
            errs = [l for l in text.splitlines() if '==ERROR==' in l or '==WARNING== No kernels' in l]
            print('   ' + ('\n   '.join(errs[:5]) if errs else 'no ncu kernel sections found'))
        for k in ks:
            print(fmt(k))
    return 0


if __name__ == '__main__':
    sys.exit(main())
