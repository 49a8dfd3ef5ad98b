// The console's build: one page, served by the router and by `polychip serve` under /console/.
// Output goes into the Python package, where it is committed (tests/test_console_bundle.py).
import { defineConfig } from 'vite';

export default defineConfig({
  base: '/console/',
  build: {
    outDir: '../polychip/console/static',
    emptyOutDir: true,
    assetsInlineLimit: 0,        // no data: URLs; the CSP allows only 'self'
    modulePreload: { polyfill: false },
    reportCompressedSize: true,
  },
});
