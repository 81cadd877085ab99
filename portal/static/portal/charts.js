// Draws every figure the server embedded as JSON next to its chart element.
// In dark mode the figures take the page's dark colours; their data colours,
// which carry meaning (failed in red), stay as they are.
(function () {
  "use strict";
  if (!window.Plotly) { return; }
  var config = { displaylogo: false, responsive: true,
                 modeBarButtonsToRemove: ["lasso2d", "select2d"] };
  var dark = window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches;
  document.querySelectorAll(".plot[data-figure]").forEach(function (element) {
    var source = document.getElementById(element.getAttribute("data-figure"));
    if (!source) { return; }
    var figure = JSON.parse(source.textContent);
    var layout = figure.layout || {};
    if (dark) {
      layout.paper_bgcolor = "#111827";
      layout.plot_bgcolor = "#111827";
      layout.font = Object.assign({}, layout.font, { color: "#e5e7eb" });
      if (layout.title && layout.title.font) { layout.title.font.color = "#f3f4f6"; }
      ["xaxis", "yaxis"].forEach(function (axis) {
        layout[axis] = Object.assign({}, layout[axis], { gridcolor: "#374151", linecolor: "#374151" });
      });
    }
    window.Plotly.newPlot(element, figure.data || [], layout, config);
  });
})();
