// Small display helpers.
export const pct = (x) => (x == null ? '–' : `${(x * 100).toFixed(x >= 0.1 ? 0 : 1)}%`);
export const ms = (s) => (s == null ? '–' : `${(s * 1000).toFixed(s < 0.1 ? 1 : 0)} ms`);
export const num = (x, d = 1) => (x == null ? '–' : Number(x).toFixed(d));

export function bytes(n) {
  if (n == null) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function age(s) {
  if (s == null) return '–';
  if (s < 90) return `${Math.round(s)} s`;
  if (s < 5400) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

// a time as epoch seconds (OpenAI's created_at) or an ISO string
export function when(t) {
  if (t == null || t === '') return '–';
  const d = typeof t === 'number' ? new Date(t * 1000) : new Date(t);
  return Number.isNaN(d.getTime()) ? String(t) : d.toLocaleString();
}
