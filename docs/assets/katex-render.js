// Renders the math that pymdownx.arithmatex (generic mode) leaves in the pages and in the API
// reference's docstrings: <span class="arithmatex">\(...\)</span> inline, <div class="arithmatex">\[...\]</div>
// displayed.  KaTeX is served with the site (docs/assets/katex/: katex.min.js, katex.min.css and the
// woff2 fonts of the npm package katex 0.19.1, MIT), so the pages render without a network.
// To update it: `npm pack katex@VERSION`, then copy package/dist/katex.min.{js,css},
// package/dist/fonts/*.woff2 and package/LICENSE over docs/assets/katex/.
(function () {
  function render(root) {
    root.querySelectorAll(".arithmatex").forEach(function (element) {
      if (element.dataset.rendered) return;
      var tex = element.textContent.trim();
      var display = tex.indexOf("\\[") === 0;  // \[...\] displayed, \(...\) inline
      tex = tex.replace(/^\\[(\[]/, "").replace(/\\[)\]]$/, "");
      katex.render(tex, element, { displayMode: display, throwOnError: false });
      element.dataset.rendered = "1";
    });
  }
  // Material's instant navigation swaps the page without reloading: document$ announces each page.
  if (typeof document$ !== "undefined") {
    document$.subscribe(function () { render(document); });
  } else {
    document.addEventListener("DOMContentLoaded", function () { render(document); });
  }
})();
