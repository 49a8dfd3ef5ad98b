// One uPlot time-series chart; it follows its container's width.
import uPlot from 'uplot';
import { useEffect, useRef } from 'preact/hooks';
import { html } from './html.js';

const COLORS = ['#1f6feb', '#d2691e', '#2da44e', '#a371f7', '#cf222e', '#8c959f'];

export function Chart({ title, t, lines, unit = '', scale = 1, dots = false }) {
  const box = useRef(null);
  const plot = useRef(null);
  const names = lines.map((l) => l.label).join('|');
  const data = [t, ...lines.map((l) => l.values.map((v) => (v == null ? null : v * scale)))];
  useEffect(() => {
    const opts = {
      width: box.current.clientWidth || 300,
      height: 170,
      legend: { live: false },
      cursor: { drag: { x: false, y: false } },
      scales: { y: { range: (u, lo, hi) => [0, Math.max((hi || 0) * 1.1, 1)] } },
      axes: [{}, { values: (u, ticks) => ticks.map((v) => `${+v.toPrecision(3)}${unit}`), size: 60 }],
      // dots for a line with gaps (percentiles of steps without requests): a lone figure stays visible
      series: [{}, ...lines.map((l, i) => ({ label: l.label, stroke: COLORS[i % COLORS.length], width: 1.5,
                                             ...(dots ? { points: { show: true, size: 4, fill: COLORS[i % COLORS.length] } } : {}) }))],
    };
    plot.current = new uPlot(opts, data, box.current);
    const watch = new ResizeObserver(() => plot.current.setSize({ width: box.current.clientWidth, height: 170 }));
    watch.observe(box.current);
    return () => {
      watch.disconnect();
      plot.current.destroy();
    };
  }, [names, unit, dots]);
  useEffect(() => {
    plot.current.setData(data);
  });
  return html`<figure class="chart"><figcaption>${title}</figcaption><div ref=${box}></div></figure>`;
}
